"""Data only: `reference.tar.xz`, the trained reference model that `cde serve` serves when no
`--model` is given (unpacked by `worker.demo_model`; how it was made: docs/reference-model.md)."""
