//! Fuzzes the KV-event decoder (`kvroute_protocol::kv_events`): any payload, and any split
//! of the input into ZeroMQ frames, must decode or fail with an error — never panic, hang
//! or allocate without bound. Decoded batches are also fed to a precise index, which must
//! accept whatever the decoder lets through.
#![no_main]

use bytes::Bytes;
use kvroute_core::precise::{PreciseConfig, PreciseIndex, StoredBlocks, Tier};
use kvroute_core::types::{Nanos, WorkerId};
use kvroute_protocol::kv_events::{KvEvent, decode, parse_frames};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The whole input as one msgpack payload.
    if let Ok((batch, _)) = decode(data) {
        let mut ix = PreciseIndex::new(PreciseConfig { max_blocks_per_worker: 4096, max_entries: 4096, ..Default::default() });
        for e in &batch.events {
            match e {
                KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium, .. } => ix.stored(
                    WorkerId(0),
                    StoredBlocks {
                        engine_hashes: block_hashes,
                        parent: *parent_block_hash,
                        token_ids,
                        block_size: *block_size,
                        tier: Tier::of_medium(medium.as_deref()),
                    },
                    Nanos(0),
                ),
                KvEvent::BlockRemoved { block_hashes, medium, .. } => {
                    ix.removed(WorkerId(0), block_hashes, Tier::of_medium(medium.as_deref()))
                }
                KvEvent::AllBlocksCleared => ix.clear(WorkerId(0)),
            }
        }
    }
    // The input split into frames at 0xFF bytes, as a multipart message.
    let frames: Vec<Bytes> = data.split(|b| *b == 0xff).map(Bytes::copy_from_slice).collect();
    if let Ok((_, _, payload)) = parse_frames(&frames) {
        let _ = decode(&payload);
    }
});
