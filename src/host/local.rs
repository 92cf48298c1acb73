//! The agent's local socket, as both sides name it: shard `i` listens on
//! the Unix stream socket `<heartbeat path>.sock.<i>`, beside the heartbeat
//! in the agent's directory, so that a client that finds the heartbeat
//! finds the socket with no configuration (a container that mounts the
//! agent's directory too). Each frame on it is a u32 little-endian length
//! and one FlatBuffers message ([`lbagent_wire::frame`]), the same
//! messages as the shard's UDP port.

use std::path::{Path, PathBuf};

/// Shard `shard`'s local socket for the agent whose heartbeat is
/// `heartbeat`.
pub fn socket_path(heartbeat: &Path, shard: u32) -> PathBuf {
    let mut p = heartbeat.as_os_str().to_owned();
    p.push(format!(".sock.{shard}"));
    PathBuf::from(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_shard_has_its_socket_beside_the_heartbeat() {
        assert_eq!(
            socket_path(Path::new("/run/lbagent/heartbeat"), 3),
            PathBuf::from("/run/lbagent/heartbeat.sock.3")
        );
    }
}
