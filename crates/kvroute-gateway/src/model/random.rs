//! Randomness the gateway needs from the operating system.

/// 64 bits from the operating system's randomness (the standard library's `RandomState`
/// keys are drawn from it): replica ids and the recorder's salt, which must differ between
/// processes and starts and must not be guessable.
pub fn os_random_u64() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x6b76_726f_7574_6552_u64)
}
