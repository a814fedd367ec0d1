//! Byte-level views of MLX arrays.
