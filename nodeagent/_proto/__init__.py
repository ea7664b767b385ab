"""Generated from proto/peertrain/v1 by `make proto`; do not edit."""
