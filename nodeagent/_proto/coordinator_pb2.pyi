from . import wire_pb2 as _wire_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_PENDING: _ClassVar[JobState]
    JOB_RUNNING: _ClassVar[JobState]
    JOB_FINISHED: _ClassVar[JobState]
    JOB_STOPPED: _ClassVar[JobState]
    JOB_FAILED: _ClassVar[JobState]

class RendezvousOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RENDEZVOUS_OP_UNSPECIFIED: _ClassVar[RendezvousOp]
    RENDEZVOUS_SET: _ClassVar[RendezvousOp]
    RENDEZVOUS_GET: _ClassVar[RendezvousOp]
    RENDEZVOUS_ADD: _ClassVar[RendezvousOp]
    RENDEZVOUS_COMPARE_SET: _ClassVar[RendezvousOp]
    RENDEZVOUS_CHECK: _ClassVar[RendezvousOp]
    RENDEZVOUS_WAIT: _ClassVar[RendezvousOp]
    RENDEZVOUS_DELETE: _ClassVar[RendezvousOp]
JOB_STATE_UNSPECIFIED: JobState
JOB_PENDING: JobState
JOB_RUNNING: JobState
JOB_FINISHED: JobState
JOB_STOPPED: JobState
JOB_FAILED: JobState
RENDEZVOUS_OP_UNSPECIFIED: RendezvousOp
RENDEZVOUS_SET: RendezvousOp
RENDEZVOUS_GET: RendezvousOp
RENDEZVOUS_ADD: RendezvousOp
RENDEZVOUS_COMPARE_SET: RendezvousOp
RENDEZVOUS_CHECK: RendezvousOp
RENDEZVOUS_WAIT: RendezvousOp
RENDEZVOUS_DELETE: RendezvousOp

class EnrollRequest(_message.Message):
    __slots__ = ("token", "csr_pem")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    token: str
    csr_pem: bytes
    def __init__(self, token: _Optional[str] = ..., csr_pem: _Optional[bytes] = ...) -> None: ...

class RenewCertificateRequest(_message.Message):
    __slots__ = ("csr_pem",)
    CSR_PEM_FIELD_NUMBER: _ClassVar[int]
    csr_pem: bytes
    def __init__(self, csr_pem: _Optional[bytes] = ...) -> None: ...

class CertificateReply(_message.Message):
    __slots__ = ("certificate_pem", "name", "serial")
    CERTIFICATE_PEM_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    certificate_pem: bytes
    name: str
    serial: str
    def __init__(self, certificate_pem: _Optional[bytes] = ..., name: _Optional[str] = ..., serial: _Optional[str] = ...) -> None: ...

class CreateJoinTokenRequest(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class CreateJoinTokenReply(_message.Message):
    __slots__ = ("token", "expires_unix", "ca_fingerprint")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    CA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    token: str
    expires_unix: float
    ca_fingerprint: str
    def __init__(self, token: _Optional[str] = ..., expires_unix: _Optional[float] = ..., ca_fingerprint: _Optional[str] = ...) -> None: ...

class RevokeCertificateRequest(_message.Message):
    __slots__ = ("serial", "name")
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    serial: str
    name: str
    def __init__(self, serial: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RevokeCertificateReply(_message.Message):
    __slots__ = ("serials",)
    SERIALS_FIELD_NUMBER: _ClassVar[int]
    serials: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, serials: _Optional[_Iterable[str]] = ...) -> None: ...

class ListCertificatesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CertificateInfo(_message.Message):
    __slots__ = ("serial", "role", "name", "issued_unix", "not_after_unix", "revoked_unix")
    SERIAL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ISSUED_UNIX_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_UNIX_FIELD_NUMBER: _ClassVar[int]
    REVOKED_UNIX_FIELD_NUMBER: _ClassVar[int]
    serial: str
    role: str
    name: str
    issued_unix: float
    not_after_unix: float
    revoked_unix: float
    def __init__(self, serial: _Optional[str] = ..., role: _Optional[str] = ..., name: _Optional[str] = ..., issued_unix: _Optional[float] = ..., not_after_unix: _Optional[float] = ..., revoked_unix: _Optional[float] = ...) -> None: ...

class ListCertificatesReply(_message.Message):
    __slots__ = ("certificates",)
    CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    certificates: _containers.RepeatedCompositeFieldContainer[CertificateInfo]
    def __init__(self, certificates: _Optional[_Iterable[_Union[CertificateInfo, _Mapping]]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("node_id", "peer_address", "metrics_address", "name", "device", "version", "device_name", "device_memory_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    peer_address: str
    metrics_address: str
    name: str
    device: str
    version: str
    device_name: str
    device_memory_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., peer_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., name: _Optional[str] = ..., device: _Optional[str] = ..., version: _Optional[str] = ..., device_name: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("node_id", "heartbeat_interval_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    heartbeat_interval_s: float
    def __init__(self, node_id: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("known", "assignment_version")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    known: bool
    assignment_version: int
    def __init__(self, known: _Optional[bool] = ..., assignment_version: _Optional[int] = ...) -> None: ...

class WatchAssignmentRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class Neighbor(_message.Message):
    __slots__ = ("rank", "node_id", "address", "sign", "phase", "weight", "up", "peer_phase")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIGN_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    PEER_PHASE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    address: str
    sign: int
    phase: int
    weight: float
    up: bool
    peer_phase: int
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., address: _Optional[str] = ..., sign: _Optional[int] = ..., phase: _Optional[int] = ..., weight: _Optional[float] = ..., up: _Optional[bool] = ..., peer_phase: _Optional[int] = ...) -> None: ...

class PeerSet(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("version", "job_id", "state", "job_spec_json", "rank", "world_size", "neighbors", "self_weight", "run_dir", "peer_schedule", "rejoin", "revoked_serials", "topology_version", "switch_step", "topology_kind", "joined_at_step")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEIGHBORS_FIELD_NUMBER: _ClassVar[int]
    SELF_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    PEER_SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    REVOKED_SERIALS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SWITCH_STEP_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_KIND_FIELD_NUMBER: _ClassVar[int]
    JOINED_AT_STEP_FIELD_NUMBER: _ClassVar[int]
    version: int
    job_id: str
    state: JobState
    job_spec_json: str
    rank: int
    world_size: int
    neighbors: _containers.RepeatedCompositeFieldContainer[Neighbor]
    self_weight: float
    run_dir: str
    peer_schedule: _containers.RepeatedCompositeFieldContainer[PeerSet]
    rejoin: bool
    revoked_serials: _containers.RepeatedScalarFieldContainer[str]
    topology_version: int
    switch_step: int
    topology_kind: str
    joined_at_step: int
    def __init__(self, version: _Optional[int] = ..., job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., job_spec_json: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., neighbors: _Optional[_Iterable[_Union[Neighbor, _Mapping]]] = ..., self_weight: _Optional[float] = ..., run_dir: _Optional[str] = ..., peer_schedule: _Optional[_Iterable[_Union[PeerSet, _Mapping]]] = ..., rejoin: _Optional[bool] = ..., revoked_serials: _Optional[_Iterable[str]] = ..., topology_version: _Optional[int] = ..., switch_step: _Optional[int] = ..., topology_kind: _Optional[str] = ..., joined_at_step: _Optional[int] = ...) -> None: ...

class MetricsReport(_message.Message):
    __slots__ = ("node_id", "job_id", "rank", "step", "loss", "test_accuracy", "test_loss", "elapsed_s", "finished", "bytes_sent", "bytes_received", "compute_s", "wait_s", "exchanges", "exchange_failures", "edges", "local_steps", "waiting_for", "test_perplexity")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    TEST_PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job_id: str
    rank: int
    step: int
    loss: float
    test_accuracy: float
    test_loss: float
    elapsed_s: float
    finished: bool
    bytes_sent: int
    bytes_received: int
    compute_s: float
    wait_s: float
    exchanges: int
    exchange_failures: int
    edges: _containers.RepeatedCompositeFieldContainer[EdgeTraffic]
    local_steps: int
    waiting_for: str
    test_perplexity: float
    def __init__(self, node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., test_accuracy: _Optional[float] = ..., test_loss: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., finished: _Optional[bool] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., exchanges: _Optional[int] = ..., exchange_failures: _Optional[int] = ..., edges: _Optional[_Iterable[_Union[EdgeTraffic, _Mapping]]] = ..., local_steps: _Optional[int] = ..., waiting_for: _Optional[str] = ..., test_perplexity: _Optional[float] = ...) -> None: ...

class EdgeTraffic(_message.Message):
    __slots__ = ("peer", "bytes_sent", "bytes_received", "exchanges", "failures", "messages_sent", "messages_received", "last_message_age_s", "message_interval_s", "in_flight_s", "failure_reasons", "last_failure_age_s", "staleness_steps", "consensus_distance", "robust_clipped", "robust_outlying", "judged", "robust_judged")
    class FailureReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PEER_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_SENT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LAST_MESSAGE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_S_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASONS_FIELD_NUMBER: _ClassVar[int]
    LAST_FAILURE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STALENESS_STEPS_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    ROBUST_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    ROBUST_OUTLYING_FIELD_NUMBER: _ClassVar[int]
    JUDGED_FIELD_NUMBER: _ClassVar[int]
    ROBUST_JUDGED_FIELD_NUMBER: _ClassVar[int]
    peer: str
    bytes_sent: int
    bytes_received: int
    exchanges: int
    failures: int
    messages_sent: int
    messages_received: int
    last_message_age_s: float
    message_interval_s: float
    in_flight_s: float
    failure_reasons: _containers.ScalarMap[str, int]
    last_failure_age_s: float
    staleness_steps: float
    consensus_distance: float
    robust_clipped: int
    robust_outlying: int
    judged: _containers.RepeatedCompositeFieldContainer[MemberJudgement]
    robust_judged: int
    def __init__(self, peer: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., exchanges: _Optional[int] = ..., failures: _Optional[int] = ..., messages_sent: _Optional[int] = ..., messages_received: _Optional[int] = ..., last_message_age_s: _Optional[float] = ..., message_interval_s: _Optional[float] = ..., in_flight_s: _Optional[float] = ..., failure_reasons: _Optional[_Mapping[str, int]] = ..., last_failure_age_s: _Optional[float] = ..., staleness_steps: _Optional[float] = ..., consensus_distance: _Optional[float] = ..., robust_clipped: _Optional[int] = ..., robust_outlying: _Optional[int] = ..., judged: _Optional[_Iterable[_Union[MemberJudgement, _Mapping]]] = ..., robust_judged: _Optional[int] = ...) -> None: ...

class MemberJudgement(_message.Message):
    __slots__ = ("rank", "seen", "clipped", "outlying")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEEN_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    OUTLYING_FIELD_NUMBER: _ClassVar[int]
    rank: int
    seen: int
    clipped: int
    outlying: int
    def __init__(self, rank: _Optional[int] = ..., seen: _Optional[int] = ..., clipped: _Optional[int] = ..., outlying: _Optional[int] = ...) -> None: ...

class NodeFailure(_message.Message):
    __slots__ = ("node_id", "job_id", "rank", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job_id: str
    rank: int
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("time_unix", "kind", "level", "message", "rank", "node_id", "step")
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    time_unix: float
    kind: str
    level: str
    message: str
    rank: int
    node_id: str
    step: int
    def __init__(self, time_unix: _Optional[float] = ..., kind: _Optional[str] = ..., level: _Optional[str] = ..., message: _Optional[str] = ..., rank: _Optional[int] = ..., node_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class EventReport(_message.Message):
    __slots__ = ("node_id", "job_id", "events")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job_id: str
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    def __init__(self, node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ...) -> None: ...

class EventReportReply(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class JobEventsRequest(_message.Message):
    __slots__ = ("job_id", "offset", "rank", "min_level")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MIN_LEVEL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    offset: int
    rank: int
    min_level: str
    def __init__(self, job_id: _Optional[str] = ..., offset: _Optional[int] = ..., rank: _Optional[int] = ..., min_level: _Optional[str] = ...) -> None: ...

class JobEventsReply(_message.Message):
    __slots__ = ("job_id", "events", "next_offset", "state")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    events: _containers.RepeatedCompositeFieldContainer[JobEvent]
    next_offset: int
    state: JobState
    def __init__(self, job_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[JobEvent, _Mapping]]] = ..., next_offset: _Optional[int] = ..., state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class DataDescription(_message.Message):
    __slots__ = ("input_shape", "num_classes", "train_samples", "test_samples")
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TEST_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    num_classes: int
    train_samples: int
    test_samples: int
    def __init__(self, input_shape: _Optional[_Iterable[int]] = ..., num_classes: _Optional[int] = ..., train_samples: _Optional[int] = ..., test_samples: _Optional[int] = ...) -> None: ...

class JobReadyRequest(_message.Message):
    __slots__ = ("node_id", "job_id", "rank", "data", "wait_s", "missing_data")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    MISSING_DATA_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job_id: str
    rank: int
    data: DataDescription
    wait_s: float
    missing_data: str
    def __init__(self, node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., data: _Optional[_Union[DataDescription, _Mapping]] = ..., wait_s: _Optional[float] = ..., missing_data: _Optional[str] = ...) -> None: ...

class JobReadyReply(_message.Message):
    __slots__ = ("released", "job_state", "waiting_for", "reason")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    released: bool
    job_state: JobState
    waiting_for: str
    reason: str
    def __init__(self, released: _Optional[bool] = ..., job_state: _Optional[_Union[JobState, str]] = ..., waiting_for: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("node_id", "job_id", "op", "keys", "value", "expected", "amount", "wait_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job_id: str
    op: RendezvousOp
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    wait_s: float
    def __init__(self, node_id: _Optional[str] = ..., job_id: _Optional[str] = ..., op: _Optional[_Union[RendezvousOp, str]] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class RendezvousReply(_message.Message):
    __slots__ = ("found", "value", "number")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    number: int
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., number: _Optional[int] = ...) -> None: ...

class NodeFailureReply(_message.Message):
    __slots__ = ("job_state",)
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    job_state: JobState
    def __init__(self, job_state: _Optional[_Union[JobState, str]] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DeregisterReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("node_id", "drain")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    drain: bool
    def __init__(self, node_id: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class MetricsReply(_message.Message):
    __slots__ = ("job_active",)
    JOB_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    job_active: bool
    def __init__(self, job_active: _Optional[bool] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_yaml",)
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    spec_yaml: str
    def __init__(self, spec_yaml: _Optional[str] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job_id", "state", "run_dir", "warning")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    state: JobState
    run_dir: str
    warning: str
    def __init__(self, job_id: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., run_dir: _Optional[str] = ..., warning: _Optional[str] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class DeleteJobReply(_message.Message):
    __slots__ = ("job_id", "run_dir")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    run_dir: str
    def __init__(self, job_id: _Optional[str] = ..., run_dir: _Optional[str] = ...) -> None: ...

class StopJobReply(_message.Message):
    __slots__ = ("state", "job_id")
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    job_id: str
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., job_id: _Optional[str] = ...) -> None: ...

class ChangeTopologyRequest(_message.Message):
    __slots__ = ("job_id", "kind", "options_json", "seed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    kind: str
    options_json: str
    seed: int
    def __init__(self, job_id: _Optional[str] = ..., kind: _Optional[str] = ..., options_json: _Optional[str] = ..., seed: _Optional[int] = ...) -> None: ...

class ChangeTopologyReply(_message.Message):
    __slots__ = ("job_id", "topology_version", "switch_step", "previous_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SWITCH_STEP_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    topology_version: int
    switch_step: int
    previous_kind: str
    def __init__(self, job_id: _Optional[str] = ..., topology_version: _Optional[int] = ..., switch_step: _Optional[int] = ..., previous_kind: _Optional[str] = ...) -> None: ...

class QuarantineRequest(_message.Message):
    __slots__ = ("job_id", "node", "release")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    node: str
    release: bool
    def __init__(self, job_id: _Optional[str] = ..., node: _Optional[str] = ..., release: _Optional[bool] = ...) -> None: ...

class QuarantineReply(_message.Message):
    __slots__ = ("job_id", "rank", "node_id", "outcome")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    node_id: str
    outcome: str
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., node_id: _Optional[str] = ..., outcome: _Optional[str] = ...) -> None: ...

class ListNodesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "name", "peer_address", "metrics_address", "up", "last_seen_unix", "job_id", "rank", "device", "draining", "device_name", "device_memory_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    peer_address: str
    metrics_address: str
    up: bool
    last_seen_unix: float
    job_id: str
    rank: int
    device: str
    draining: bool
    device_name: str
    device_memory_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., peer_address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., up: _Optional[bool] = ..., last_seen_unix: _Optional[float] = ..., job_id: _Optional[str] = ..., rank: _Optional[int] = ..., device: _Optional[str] = ..., draining: _Optional[bool] = ..., device_name: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ...) -> None: ...

class ListNodesReply(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class JobStatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("job_id", "name", "state", "world_size", "created_unix", "started_unix", "ended_unix", "reason", "min_nodes", "max_nodes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: JobState
    world_size: int
    created_unix: float
    started_unix: float
    ended_unix: float
    reason: str
    min_nodes: int
    max_nodes: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., world_size: _Optional[int] = ..., created_unix: _Optional[float] = ..., started_unix: _Optional[float] = ..., ended_unix: _Optional[float] = ..., reason: _Optional[str] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class NodeProgress(_message.Message):
    __slots__ = ("rank", "node_id", "step", "loss", "test_accuracy", "finished", "updated_unix", "bytes_sent", "bytes_received", "test_loss", "elapsed_s", "compute_s", "wait_s", "exchanges", "exchange_failures", "state", "failure", "local_steps", "edges", "waiting_for", "test_perplexity", "recent_steps_per_s", "suspicion", "quarantined", "suspected")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TEST_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TEST_LOSS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    EXCHANGES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    EDGES_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    TEST_PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SUSPICION_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    SUSPECTED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    step: int
    loss: float
    test_accuracy: float
    finished: bool
    updated_unix: float
    bytes_sent: int
    bytes_received: int
    test_loss: float
    elapsed_s: float
    compute_s: float
    wait_s: float
    exchanges: int
    exchange_failures: int
    state: str
    failure: str
    local_steps: int
    edges: _containers.RepeatedCompositeFieldContainer[EdgeTraffic]
    waiting_for: str
    test_perplexity: float
    recent_steps_per_s: float
    suspicion: float
    quarantined: bool
    suspected: bool
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., step: _Optional[int] = ..., loss: _Optional[float] = ..., test_accuracy: _Optional[float] = ..., finished: _Optional[bool] = ..., updated_unix: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., test_loss: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., exchanges: _Optional[int] = ..., exchange_failures: _Optional[int] = ..., state: _Optional[str] = ..., failure: _Optional[str] = ..., local_steps: _Optional[int] = ..., edges: _Optional[_Iterable[_Union[EdgeTraffic, _Mapping]]] = ..., waiting_for: _Optional[str] = ..., test_perplexity: _Optional[float] = ..., recent_steps_per_s: _Optional[float] = ..., suspicion: _Optional[float] = ..., quarantined: _Optional[bool] = ..., suspected: _Optional[bool] = ...) -> None: ...

class JobStatusReply(_message.Message):
    __slots__ = ("job_id", "name", "state", "world_size", "nodes", "run_dir", "created_unix", "spec_yaml", "reason", "started_unix", "ended_unix", "min_nodes", "max_nodes", "task", "server_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SPEC_YAML_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ENDED_UNIX_FIELD_NUMBER: _ClassVar[int]
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    name: str
    state: JobState
    world_size: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeProgress]
    run_dir: str
    created_unix: float
    spec_yaml: str
    reason: str
    started_unix: float
    ended_unix: float
    min_nodes: int
    max_nodes: int
    task: str
    server_version: int
    def __init__(self, job_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., world_size: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeProgress, _Mapping]]] = ..., run_dir: _Optional[str] = ..., created_unix: _Optional[float] = ..., spec_yaml: _Optional[str] = ..., reason: _Optional[str] = ..., started_unix: _Optional[float] = ..., ended_unix: _Optional[float] = ..., min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., task: _Optional[str] = ..., server_version: _Optional[int] = ...) -> None: ...

class PsPushReply(_message.Message):
    __slots__ = ("version", "applied", "rejected", "delay", "bytes_received", "duplicate")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DELAY_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied: bool
    rejected: str
    delay: int
    bytes_received: int
    duplicate: bool
    def __init__(self, version: _Optional[int] = ..., applied: _Optional[bool] = ..., rejected: _Optional[str] = ..., delay: _Optional[int] = ..., bytes_received: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class PsPullRequest(_message.Message):
    __slots__ = ("job_id", "rank", "node_id", "since_version", "delta")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    node_id: str
    since_version: int
    delta: bool
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., node_id: _Optional[str] = ..., since_version: _Optional[int] = ..., delta: _Optional[bool] = ...) -> None: ...

class PsReportRequest(_message.Message):
    __slots__ = ("job_id", "rank", "node_id", "version", "round_step", "duration_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_STEP_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    node_id: str
    version: int
    round_step: int
    duration_s: float
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ..., node_id: _Optional[str] = ..., version: _Optional[int] = ..., round_step: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class PsReportReply(_message.Message):
    __slots__ = ("ready", "version", "steps_before_asking")
    READY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_BEFORE_ASKING_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    version: int
    steps_before_asking: int
    def __init__(self, ready: _Optional[bool] = ..., version: _Optional[int] = ..., steps_before_asking: _Optional[int] = ...) -> None: ...

class UploadModelReply(_message.Message):
    __slots__ = ("bytes_received",)
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    bytes_received: int
    def __init__(self, bytes_received: _Optional[int] = ...) -> None: ...

class ExportModelRequest(_message.Message):
    __slots__ = ("job_id", "rank")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    rank: int
    def __init__(self, job_id: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class ExportedModel(_message.Message):
    __slots__ = ("job_id", "spec_json", "data", "source", "ranks", "step", "metric_name", "metric_value", "metric_of")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    METRIC_NAME_FIELD_NUMBER: _ClassVar[int]
    METRIC_VALUE_FIELD_NUMBER: _ClassVar[int]
    METRIC_OF_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    spec_json: str
    data: DataDescription
    source: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    step: int
    metric_name: str
    metric_value: float
    metric_of: str
    def __init__(self, job_id: _Optional[str] = ..., spec_json: _Optional[str] = ..., data: _Optional[_Union[DataDescription, _Mapping]] = ..., source: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., metric_name: _Optional[str] = ..., metric_value: _Optional[float] = ..., metric_of: _Optional[str] = ...) -> None: ...

class ModelExport(_message.Message):
    __slots__ = ("model", "frame")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    model: ExportedModel
    frame: _wire_pb2.Frame
    def __init__(self, model: _Optional[_Union[ExportedModel, _Mapping]] = ..., frame: _Optional[_Union[_wire_pb2.Frame, _Mapping]] = ...) -> None: ...
