"""The standard attacks of a Byzantine member, as tensor functions: what `simulation.byzantine` makes a lying rank send
(nodeagent.runtime.simulator), and what a hostile client of the tests can send over the wire. Torch only: no other
module of the project is needed to use it.

A liar trains as an honest member does, and replaces each tensor message it sends, `own` (what it would have sent),
by `forge(attack, own, honest, receiver)`; the attacker is omniscient, as in the papers: `honest` are the latest
messages of the same kind from the honest members, `receiver` the receiving member's own latest one (dissensus).
Entries that are not floating point (codes, indices) are sent unchanged.
- sign-flip: -own;
- scale: own * s (s = 1e6 unset: the issue's "model times 1e6");
- constant: every entry s (1000 unset);
- zeros;
- random: Gaussian noise of standard deviation s (1 unset);
- alie ("a little is enough", Baruch et al. 2019): mean - z * std of the honest messages, coordinate-wise (z = s, 1
  unset);
- ipm (inner-product manipulation, Xie et al. 2020): -s * mean of the honest messages (s = 0.1 unset);
- dissensus (He, Karimireddy and Jaggi 2022): the receiver's own value pushed away from the honest mean,
  r - s * (mean - r) (s = 1 unset), which drives neighbours apart rather than towards a bad model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

ATTACKS = ("sign-flip", "scale", "constant", "zeros", "random", "alie", "ipm", "dissensus")
DEFAULT_STRENGTH = {"scale": 1e6, "constant": 1000.0, "random": 1.0, "alie": 1.0, "ipm": 0.1, "dissensus": 1.0}

Tensors = Mapping[str, torch.Tensor]


def forge_tensor(attack: str, own: torch.Tensor, honest: Sequence[torch.Tensor], receiver: torch.Tensor | None,
                 strength: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One tensor of a liar's message (see the module's text)."""
    if attack not in ATTACKS:
        raise ValueError(f"unknown attack {attack!r}; known: {', '.join(ATTACKS)}")
    if not own.is_floating_point():
        return own
    s = DEFAULT_STRENGTH.get(attack, 0.0) if strength is None else strength
    if attack == "sign-flip":
        return -own
    if attack == "scale":
        return own * s
    if attack == "constant":
        return torch.full_like(own, s)
    if attack == "zeros":
        return torch.zeros_like(own)
    if attack == "random":
        noise = torch.randn(own.shape, generator=generator, dtype=own.dtype, device="cpu")
        return (noise * s).to(own.device)
    pool = [t.to(own.device) for t in honest if t.shape == own.shape] or [own]
    stacked = torch.stack(pool)
    mean = stacked.mean(dim=0)
    if attack == "ipm":
        return -s * mean
    if attack == "alie":
        std = stacked.std(dim=0, correction=0) if len(pool) > 1 else torch.zeros_like(mean)
        return mean - s * std
    base = own if receiver is None or receiver.shape != own.shape else receiver.to(own.device)
    return base - s * (mean - base)  # dissensus


def forge(attack: str, own: Tensors, honest: Sequence[Tensors], receiver: Tensors | None = None,
          strength: float | None = None, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """A liar's message: each of `own`'s tensors forged against the same-named tensors of the others."""
    return {
        name: forge_tensor(attack, tensor, [h[name] for h in honest if name in h],
                           None if receiver is None else receiver.get(name), strength, generator)
        for name, tensor in own.items()
    }
