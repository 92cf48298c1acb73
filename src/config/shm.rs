//! The `[shm]` table: the agent's shared-memory transport (issue 16).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{absolute, in_range, ConfigError};

/// The `[shm]` table. Off by default: UDP stays the default transport.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShmConfig {
    /// Offer a shared-memory region per shard (named in the heartbeat).
    pub enabled: bool,
    /// The directory of the region files (`<dir>/<heartbeat file name>.shm.<shard>`):
    /// the agent's, checked as the heartbeat's (`lbagent_host::owned`).
    pub dir: PathBuf,
    /// Slots per shard: client threads attached at once (more fall back
    /// to UDP).
    pub slots: u32,
    /// A group whose members may use the regions too (mode 0660); empty:
    /// only the agent's user (mode 0600).
    pub group: String,
}

impl Default for ShmConfig {
    fn default() -> Self {
        ShmConfig {
            enabled: false,
            dir: PathBuf::from("/run/lbagent"),
            slots: 64,
            group: String::new(),
        }
    }
}

impl ShmConfig {
    /// Checks every field.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        absolute("shm.dir", &self.dir)?;
        in_range("shm.slots", self.slots, 1, lbagent_shm::layout::MAX_SLOTS)?;
        if !self.group.is_empty() && lbagent_shm::region::group_id(&self.group).is_none() {
            return Err(ConfigError::Invalid {
                field: "shm.group",
                value: format!("\"{}\"", self.group),
                allowed: "a group this host knows (getent group), or \"\" for none".into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::Config;

    #[test]
    fn the_shm_table_is_checked_field_by_field() {
        let ok = Config::from_toml("[shm]\nenabled = true\nslots = 4\n").unwrap();
        assert!(ok.shm.enabled && ok.shm.slots == 4 && ok.shm.group.is_empty());
        for (text, field) in [
            ("[shm]\nslots = 0\n", "shm.slots"),
            ("[shm]\nslots = 4097\n", "shm.slots"),
            ("[shm]\ndir = \"relative\"\n", "shm.dir"),
            ("[shm]\ngroup = \"no-such-group-lbagent\"\n", "shm.group"),
        ] {
            let e = Config::from_toml(text).unwrap_err().to_string();
            assert!(e.contains(field), "{text}: {e}");
        }
        let e = Config::from_toml("[shm]\nsize = 1\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("size"), "{e}");
    }

    #[test]
    fn a_changed_shm_table_needs_a_restart() {
        use crate::reload::{reloadable, Reloadable, Role};
        assert_eq!(reloadable(Role::Agent, "shm.enabled"), Reloadable::Restart);
        assert_eq!(
            reloadable(Role::Dnsserver, "shm.slots"),
            Reloadable::Ignored
        );
    }
}
