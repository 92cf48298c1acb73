//! What the lbagent agent and its clients share on one host, both sides of
//! each: the files the agent writes and clients read, the datagram I/O both
//! use, and the clocks their timestamps come from. No runtime, no server
//! dependency: the client library builds on this crate alone (with the wire
//! format and shared memory).
//!
//! # Layout
//!
//! - [`heartbeat`]: the shared-memory heartbeat file (writer and reader).
//! - [`snapshot`]: the static route file, written atomically, read back.
//! - [`owned`]: files only the agent's user can plant: the agent
//!   directory, exclusive creation, what the agent adopts and clients trust.
//! - [`local`]: where each shard's local (Unix) socket is.
//! - [`udp`]: batched datagram I/O (recvmmsg / sendmmsg), socket options,
//!   the request size limit.
//! - [`clock`]: monotonic milliseconds and Unix time.
#![warn(missing_docs)]

pub mod clock;
pub mod heartbeat;
pub mod local;
pub mod owned;
pub mod snapshot;
pub mod udp;
