//! The shared-memory transport between applications and the agent's
//! shards (issue 16), beside UDP: each shard publishes a region file whose
//! slots client threads claim; a request is the same FlatBuffers datagram
//! UDP carries, or for getHost and report (and the getHost answer) a
//! fixed little-endian record ([`fixed`]), decoded into the same request,
//! so every request kind, answer, L5 and DAGOR decision is the same. See
//! the README's "Shared memory" section.
//!
//! # Layout
//!
//! - [`layout`]: offsets and the pure checks on what a slot holds;
//! - [`region`]: the mapping, atomics, futex and pid calls (the only
//!   `unsafe` of the transport);
//! - [`serve`]: the shard's side; [`attach`]: a client thread's side.
//! - [`wait`]: how a waiting client spins, naps and sleeps (pure).
//! - [`fixed`]: the fixed layout of the hot requests (pure).
//! - [`lease`]: slots leased over the agent's local socket, whatever
//!   pid namespace the client runs in (the table is pure).
#![warn(missing_docs)]

pub mod attach;
pub mod fixed;
pub mod layout;
pub mod lease;
pub mod region;
pub mod serve;
pub mod wait;

/// The region file of shard `shard`, given the prefix the heartbeat names.
pub fn region_path(prefix: &std::path::Path, shard: u32) -> std::path::PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    p.push(format!(".{shard}"));
    std::path::PathBuf::from(p)
}
