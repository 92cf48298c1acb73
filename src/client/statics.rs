//! The static route file as the client uses it while the agent is down:
//! loaded once, re-read only when the file changed (its inode, size or
//! modification time), and asked for a random node of a module.
//!
//! Owns the loaded [`Snapshot`] (or why it could not be loaded). The file
//! format and its validation belong to [`lbagent_host::snapshot`]: whatever
//! the bytes, the answer is a node the agent wrote, or an error.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use lbagent_host::snapshot::{self, Snapshot};
use lbagent_model::{ModuleId, NodeAddr};

/// What identifies one version of the file: a rename over it changes the
/// inode, a rewrite in place the size or the modification time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Signature {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_s: i64,
    mtime_ns: i64,
}

#[derive(Debug)]
struct Loaded {
    path: PathBuf,
    signature: Signature,
    snapshot: Result<Snapshot, String>,
}

/// The static routes, loaded lazily and kept until the file changes.
#[derive(Debug, Default)]
pub(crate) struct StaticRoutes {
    loaded: Option<Loaded>,
    loads: u64,
}

impl StaticRoutes {
    /// A random node (`r` picks it) of `module` in the file at `path`:
    /// `Ok(None)` when the file has no node of the module, `Err` with the
    /// reason when the file cannot be read or is invalid. One `stat` per
    /// call; the file is read only when it changed since the last read.
    pub fn random_node(
        &mut self,
        path: &Path,
        module: ModuleId,
        r: u64,
    ) -> Result<Option<NodeAddr>, String> {
        let snapshot = self.current(path)?;
        Ok(snapshot.random_node(module, r))
    }

    /// How many times the file was read (for tests).
    #[cfg(test)]
    pub fn loads(&self) -> u64 {
        self.loads
    }

    fn current(&mut self, path: &Path) -> Result<&Snapshot, String> {
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.loaded = None;
                return Err(format!(
                    "static route file {} does not exist (the agent writes it every \
                     agent.snapshot_interval seconds once it has routes)",
                    path.display()
                ));
            }
            Err(e) => {
                self.loaded = None;
                return Err(format!(
                    "cannot stat static route file {}: {e}",
                    path.display()
                ));
            }
        };
        let signature = Signature {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_s: meta.mtime(),
            mtime_ns: meta.mtime_nsec(),
        };
        let fresh = self
            .loaded
            .as_ref()
            .is_some_and(|l| l.path == path && l.signature == signature);
        if !fresh {
            self.loads += 1;
            self.loaded = Some(Loaded {
                path: path.to_path_buf(),
                signature,
                snapshot: snapshot::read(path).map_err(|e| e.to_string()),
            });
        }
        match &self.loaded {
            Some(Loaded {
                snapshot: Ok(s), ..
            }) => Ok(s),
            Some(Loaded {
                snapshot: Err(e), ..
            }) => Err(e.clone()),
            None => Err(format!("static route file {} not loaded", path.display())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lbagent_host::snapshot::SnapshotRoute;
    use lbagent_model::RouteNode;
    use std::net::Ipv4Addr;

    const M: ModuleId = ModuleId::new(7, 1);

    fn node(i: u8) -> NodeAddr {
        NodeAddr::new(Ipv4Addr::new(10, 0, 0, i), 80)
    }

    fn write(path: &Path, nodes: &[NodeAddr]) {
        let route = SnapshotRoute {
            module: M,
            version: 1,
            nodes: nodes
                .iter()
                .map(|&addr| RouteNode { addr, weight: 1 })
                .collect(),
            meta: Vec::new(),
        };
        snapshot::write(path, 1, &[route]).unwrap();
    }

    #[test]
    fn the_file_is_read_once_until_it_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes");
        write(&path, &[node(1), node(2)]);
        let mut s = StaticRoutes::default();
        for r in 0..10 {
            let n = s.random_node(&path, M, r).unwrap().unwrap();
            assert_eq!(n, [node(1), node(2)][r as usize % 2]);
        }
        assert_eq!(s.loads(), 1);
        write(&path, &[node(3)]);
        assert_eq!(s.random_node(&path, M, 0).unwrap(), Some(node(3)));
        assert_eq!(s.loads(), 2);
        assert_eq!(s.random_node(&path, ModuleId::new(7, 2), 0).unwrap(), None);
    }

    #[test]
    fn missing_truncated_and_corrupt_files_are_errors_and_never_a_node() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("routes");
        let mut s = StaticRoutes::default();
        let e = s.random_node(&path, M, 0).unwrap_err();
        assert!(e.contains("does not exist"), "{e}");

        write(&path, &[node(1)]);
        let good = std::fs::read(&path).unwrap();
        std::fs::write(&path, &good[..good.len() - 3]).unwrap();
        let e = s.random_node(&path, M, 0).unwrap_err();
        assert!(e.contains("truncated"), "{e}");
        // Same error again without reading the unchanged file.
        let loads = s.loads();
        assert!(s.random_node(&path, M, 0).is_err());
        assert_eq!(s.loads(), loads);

        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x40;
        std::fs::write(&path, &bad).unwrap();
        let e = s.random_node(&path, M, 0).unwrap_err();
        assert!(e.contains("corrupt"), "{e}");

        std::fs::write(&path, b"not a snapshot at all, just some text").unwrap();
        assert!(s.random_node(&path, M, 0).is_err());

        std::fs::write(&path, &good).unwrap();
        assert_eq!(s.random_node(&path, M, 0).unwrap(), Some(node(1)));
    }
}
