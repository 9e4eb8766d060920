//! # kvroute-protocol
//!
//! The wire formats kvroute speaks, shared by the gateway (`kvroute serve`) and the engine
//! simulator (`kvroute engine-sim`). Pure: no async runtime, no sockets (the purity check in
//! `scripts/test.sh` keeps it so); the optional `axum` feature only turns [`api_error::ApiError`]
//! into an HTTP response.
//!
//! - [`openai`]: what routing reads from OpenAI (`/v1/chat/completions`, `/v1/completions`)
//!   and SGLang (`/generate`) request bodies, with input validation.
//! - [`api_error`]: OpenAI-style JSON errors.
//! - [`kv_events`]: vLLM/SGLang KV-cache events (msgpack over ZeroMQ) — decode and encode.
//! - [`engine_metrics`]: load and cache signals from engines' `/metrics` and llama.cpp's `/slots`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod api_error;
pub mod engine_metrics;
pub mod kv_events;
pub mod openai;
