"""A run's configuration and orchestration: the typed configuration, the manifest and blob
layout every worker reads, process set-up, liveness and metrics, and the local cluster that
`ddiloco run` starts (docs/ARCHITECTURE.md)."""
