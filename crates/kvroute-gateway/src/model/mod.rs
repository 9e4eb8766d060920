//! The gateway's vocabulary: worker URL checks, capacity facts, locality and registration records,
//! per-tenant shares.
//! Pure data and checks, no I/O; it imports nothing else of the gateway, and every other
//! module may use it.

pub mod capacity;
pub mod locality;
pub mod random;
pub mod registration;
pub mod shares;
pub mod worker_url;
