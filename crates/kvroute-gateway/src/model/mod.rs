//! The gateway's vocabulary: worker URL checks, capacity facts, locality and registration records.
//! Pure data and checks, no I/O; it imports nothing else of the gateway, and every other
//! module may use it.

pub mod capacity;
pub mod locality;
pub mod random;
pub mod registration;
pub mod worker_url;
