//! Production KV-cache layouts (see ARCHITECTURE.md). Knows nothing of the harness.
