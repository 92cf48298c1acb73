//! Plain values every part of the system shares: a module's name, a node's
//! address, a route entry. No behaviour beyond formatting and parsing; the
//! wire format and the LB core both speak these types so neither depends on
//! the other.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

use std::fmt;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::str::FromStr;

/// A module: the remote service named by `(modid, cmdid)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModuleId {
    /// The service's module id.
    pub modid: u32,
    /// The command id within the module.
    pub cmdid: u32,
}

impl ModuleId {
    /// A module from its two ids.
    pub const fn new(modid: u32, cmdid: u32) -> Self {
        Self { modid, cmdid }
    }

    /// The shard that owns this module among `shards`: `(modid + cmdid) % shards`,
    /// summed without overflow. `shards` must not be 0.
    pub fn shard(self, shards: u32) -> u32 {
        ((u64::from(self.modid) + u64::from(self.cmdid)) % u64::from(shards)) as u32
    }
}

impl fmt::Display for ModuleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, {}]", self.modid, self.cmdid)
    }
}

/// A node of a remote service: IPv4 address and port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeAddr {
    /// IPv4 address, host byte order.
    pub ip: u32,
    /// UDP/TCP port of the service on that node.
    pub port: u16,
}

impl NodeAddr {
    /// A node from an address and a port.
    pub const fn new(ip: Ipv4Addr, port: u16) -> Self {
        Self {
            ip: u32::from_be_bytes(ip.octets()),
            port,
        }
    }

    /// The address as a standard library value.
    pub fn ipv4(self) -> Ipv4Addr {
        Ipv4Addr::from(self.ip)
    }

    /// A key that orders and identifies the node: `ip << 16 | port`.
    pub const fn key(self) -> u64 {
        ((self.ip as u64) << 16) | self.port as u64
    }
}

impl fmt::Display for NodeAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.ipv4(), self.port)
    }
}

/// Why an `IP:PORT` string is not a node address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseNodeAddrError {
    /// Not of the form `A.B.C.D:PORT`.
    #[error("`{0}` is not an IPv4 node address: expected A.B.C.D:PORT, e.g. 10.0.0.1:9000")]
    Syntax(String),
    /// Port 0 names no service.
    #[error("`{0}`: port 0 is not a service port: use 1..=65535")]
    PortZero(String),
    /// A port above 65535.
    #[error("`{0}`: the port is out of range: use 1..=65535")]
    PortRange(String),
}

impl FromStr for NodeAddr {
    type Err = ParseNodeAddrError;

    /// Parses `A.B.C.D:PORT` with a port in 1..=65535.
    ///
    /// # Errors
    /// [`ParseNodeAddrError::Syntax`] when it is not an IPv4 socket address,
    /// [`ParseNodeAddrError::PortRange`] for a port above 65535,
    /// [`ParseNodeAddrError::PortZero`] for port 0.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let sa: SocketAddrV4 = s.parse().map_err(|_| {
            let big_port = s.rsplit_once(':').is_some_and(|(ip, port)| {
                ip.parse::<std::net::Ipv4Addr>().is_ok()
                    && port.parse::<u64>().is_ok_and(|p| p > 65535)
            });
            if big_port {
                ParseNodeAddrError::PortRange(s.to_string())
            } else {
                ParseNodeAddrError::Syntax(s.to_string())
            }
        })?;
        if sa.port() == 0 {
            return Err(ParseNodeAddrError::PortZero(s.to_string()));
        }
        Ok(NodeAddr::new(*sa.ip(), sa.port()))
    }
}

/// How a module's nodes are chosen, set per module with the route.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    /// The L5 overload algorithm (round robin over the idle nodes): the default.
    #[default]
    L5,
    /// Seed 002's balance router: a node's weight is its capacity in
    /// units; getHost takes a unit, a report returns it.
    Balance,
}

impl Policy {
    /// The policy's name: `l5` or `balance`.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::L5 => "l5",
            Policy::Balance => "balance",
        }
    }

    /// The policy's number on the wire (0 = `l5`, what an older route
    /// server sends).
    pub fn code(self) -> u8 {
        match self {
            Policy::L5 => 0,
            Policy::Balance => 1,
        }
    }

    /// The policy of wire number `code`; None for an unknown one.
    pub fn from_code(code: u8) -> Option<Policy> {
        match code {
            0 => Some(Policy::L5),
            1 => Some(Policy::Balance),
            _ => None,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is neither `l5` nor `balance`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy {0:?} is not one of l5, balance")]
pub struct ParsePolicyError(pub String);

impl FromStr for Policy {
    type Err = ParsePolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "l5" => Ok(Policy::L5),
            "balance" => Ok(Policy::Balance),
            _ => Err(ParsePolicyError(s.to_string())),
        }
    }
}

/// One entry of a module's route: a node and its weight / capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RouteNode {
    /// Where the node is.
    pub addr: NodeAddr,
    /// Weight / capacity for the balance policy; 0 means unset (treated as 1).
    pub weight: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_sums_without_overflow() {
        assert_eq!(
            ModuleId::new(u32::MAX, 1).shard(3),
            ((u32::MAX as u64 + 1) % 3) as u32
        );
        assert_eq!(ModuleId::new(10, 2).shard(3), 0);
    }

    #[test]
    fn node_addr_parses_and_prints() {
        let a: NodeAddr = "10.0.0.1:9000".parse().unwrap();
        assert_eq!(a.to_string(), "10.0.0.1:9000");
        assert_eq!(a.ip, 0x0a00_0001);
    }

    #[test]
    fn node_addr_rejects_bad_input() {
        assert!(matches!(
            "10.0.0.1".parse::<NodeAddr>(),
            Err(ParseNodeAddrError::Syntax(_))
        ));
        assert!(matches!(
            "10.0.0.1:65536".parse::<NodeAddr>(),
            Err(ParseNodeAddrError::PortRange(_))
        ));
        assert!(matches!(
            "10.0.0.300:80".parse::<NodeAddr>(),
            Err(ParseNodeAddrError::Syntax(_))
        ));
        assert!(matches!(
            "10.0.0.1:0".parse::<NodeAddr>(),
            Err(ParseNodeAddrError::PortZero(_))
        ));
        assert!(matches!(
            "host:80".parse::<NodeAddr>(),
            Err(ParseNodeAddrError::Syntax(_))
        ));
    }
}
