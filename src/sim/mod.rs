//! The deterministic simulator.
