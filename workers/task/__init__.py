"""The training task: the task API a learner runs (model, loss, inner optimizer, data), how a
run picks its task, and the built-in byte-level GPT with its corpus (docs/ARCHITECTURE.md)."""
