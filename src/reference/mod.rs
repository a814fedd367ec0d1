//! The pure-Rust reference model of every layout (no MLX).
