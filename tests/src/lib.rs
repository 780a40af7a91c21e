//! End-to-end test crate (tests live in tests/tests).
