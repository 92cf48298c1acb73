//! Plain values every part of the system shares: a module's name, a node's
//! address, a route entry, a node's zone and labels and a getHost's label
//! selector (each bounded in length, count and charset). No behaviour beyond formatting and parsing; the
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

/// [`ModuleId::shard`] with the division done once, for a fixed shard
/// count: a shard checks the owner of every request, and a 64-bit division
/// costs tens of cycles. The remainder is Lemire's `fastmod` (one
/// multiplication by a precomputed inverse and one wide multiplication,
/// exact for every 32-bit dividend); a sum of ids past 32 bits divides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardOf {
    shards: u32,
    /// `⌊(2⁶⁴ − 1) / shards⌋ + 1`, wrapping (0 for one shard).
    inverse: u64,
}

impl ShardOf {
    /// The owner check for `shards` shards.
    ///
    /// # Panics
    /// When `shards` is 0.
    pub const fn new(shards: u32) -> Self {
        assert!(shards > 0, "a shard count of 0");
        ShardOf {
            shards,
            inverse: (u64::MAX / shards as u64).wrapping_add(1),
        }
    }

    /// The shard count.
    pub const fn shards(&self) -> u32 {
        self.shards
    }

    /// The shard that owns `module`: `(modid + cmdid) % shards`, as
    /// [`ModuleId::shard`].
    #[inline(always)]
    pub fn of(&self, module: ModuleId) -> u32 {
        let sum = u64::from(module.modid) + u64::from(module.cmdid);
        match u32::try_from(sum) {
            Ok(a) => {
                let low = self.inverse.wrapping_mul(u64::from(a));
                ((u128::from(low) * u128::from(self.shards)) >> 64) as u32
            }
            Err(_) => (sum % u64::from(self.shards)) as u32,
        }
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
    /// Power of two choices over the idle nodes: of two drawn at random,
    /// the one with the lower peak-EWMA of reported time cost times its
    /// outstanding getHosts + 1 (Finagle, Linkerd); L5's overload marking
    /// and probes still apply.
    P2c,
}

impl Policy {
    /// The policy's name: `l5`, `balance` or `p2c`.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::L5 => "l5",
            Policy::Balance => "balance",
            Policy::P2c => "p2c",
        }
    }

    /// The policy's number on the wire (0 = `l5`, what an older route
    /// server sends; 2 = `p2c`, which an older agent reads as `l5`).
    pub fn code(self) -> u8 {
        match self {
            Policy::L5 => 0,
            Policy::Balance => 1,
            Policy::P2c => 2,
        }
    }

    /// The policy of wire number `code`; None for an unknown one.
    pub fn from_code(code: u8) -> Option<Policy> {
        match code {
            0 => Some(Policy::L5),
            1 => Some(Policy::Balance),
            2 => Some(Policy::P2c),
            _ => None,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A policy name that is none of `l5`, `balance`, `p2c`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy {0:?} is not one of l5, balance, p2c")]
pub struct ParsePolicyError(pub String);

impl FromStr for Policy {
    type Err = ParsePolicyError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "l5" => Ok(Policy::L5),
            "balance" => Ok(Policy::Balance),
            "p2c" => Ok(Policy::P2c),
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

/// A module's own load-balancing options, stored and pushed with its
/// policy. Each is None where the module keeps the agent's default (its
/// `[lb]` table); every default is off or neutral.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ModuleOptions {
    /// A node that enters the idle list (added, or back from overload)
    /// ramps to its full weight over this many milliseconds; 0 = off.
    pub slow_start_ms: Option<u32>,
    /// The most nodes, in percent of the module's, that the overload rules
    /// mark overloaded at once (1..=100; 100 = no limit).
    pub max_overloaded_percent: Option<u8>,
    /// Below this idle share (percent, 0..=100; 0 = off) getHost answers
    /// round robin over every node instead of overloaded.
    pub panic_percent: Option<u8>,
    /// Below this idle share (percent, 0..=100) of its own zone, getHost
    /// spills over to other zones (applied by the locality code).
    pub locality_min_percent: Option<u8>,
}

/// A module option out of its range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModuleOptionsError {
    /// `max_overloaded_percent` of 0 (no node could ever be overloaded:
    /// use 100 for no limit) or above 100.
    #[error("max_overloaded_percent {0} is out of range: use 1..=100 (100 = no limit)")]
    MaxOverloaded(u8),
    /// `panic_percent` above 100.
    #[error("panic_percent {0} is out of range: use 0..=100 (0 = off)")]
    Panic(u8),
    /// `locality_min_percent` above 100.
    #[error("locality_min_percent {0} is out of range: use 0..=100")]
    LocalityMin(u8),
}

impl ModuleOptions {
    /// True when no option is set (the module follows the agent's defaults).
    pub fn is_unset(&self) -> bool {
        *self == ModuleOptions::default()
    }

    /// Checks each set option's range.
    ///
    /// # Errors
    /// The first option out of range ([`ModuleOptionsError`]).
    pub fn validate(&self) -> Result<(), ModuleOptionsError> {
        if let Some(v) = self.max_overloaded_percent.filter(|&v| v == 0 || v > 100) {
            return Err(ModuleOptionsError::MaxOverloaded(v));
        }
        if let Some(v) = self.panic_percent.filter(|&v| v > 100) {
            return Err(ModuleOptionsError::Panic(v));
        }
        if let Some(v) = self.locality_min_percent.filter(|&v| v > 100) {
            return Err(ModuleOptionsError::LocalityMin(v));
        }
        Ok(())
    }
}

impl fmt::Display for ModuleOptions {
    /// `slow_start_ms=… max_overloaded_percent=… panic_percent=…
    /// locality_min_percent=…`, `default` for an unset one.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn show<T: fmt::Display>(v: Option<T>) -> String {
            v.map_or_else(|| "default".to_string(), |v| v.to_string())
        }
        write!(
            f,
            "slow_start_ms={} max_overloaded_percent={} panic_percent={} locality_min_percent={}",
            show(self.slow_start_ms),
            show(self.max_overloaded_percent),
            show(self.panic_percent),
            show(self.locality_min_percent)
        )
    }
}

// === keys ===

/// The hash of a keyed getHost's key (consistent hashing): rapidhash V3
/// of its bytes, a persistent hash whose output the crate fixes for good,
/// so that every client and agent, on every platform, maps a key alike.
pub fn key_hash(key: &[u8]) -> u64 {
    rapidhash::v3::rapidhash_v3(key)
}

// === zones, labels, selectors ===

/// The longest zone name, label key or label value, in bytes.
pub const MAX_NAME_LEN: usize = 63;
/// The most labels one node carries, and the most terms one selector has.
pub const MAX_LABELS: usize = 16;

/// Why a zone, a label or a selector was refused. Each names the offending
/// text (cut to a readable length) and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// An empty zone, label key or selector key.
    #[error("{what} is empty: give 1 to 63 characters of A-Z a-z 0-9 . _ -")]
    Empty {
        /// Which kind of name ("zone", "label key", ...).
        what: &'static str,
    },
    /// A name longer than [`MAX_NAME_LEN`] bytes.
    #[error("{what} `{text}…` is {len} bytes long: at most 63 are allowed")]
    TooLong {
        /// Which kind of name.
        what: &'static str,
        /// Its first characters.
        text: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A character outside `A-Z a-z 0-9 . _ -`.
    #[error("{what} `{text}` has the character {bad:?}: use only A-Z a-z 0-9 . _ -")]
    Charset {
        /// Which kind of name.
        what: &'static str,
        /// The name (cut to 63 bytes).
        text: String,
        /// The first character refused.
        bad: char,
    },
    /// A label or selector term that is not `KEY=VALUE`.
    #[error("label `{0}` is not KEY=VALUE, e.g. version=canary")]
    NotKeyValue(String),
    /// More than [`MAX_LABELS`] labels or selector terms.
    #[error("{what} has {count} entries: at most 16 are allowed")]
    TooMany {
        /// "labels" or "selector".
        what: &'static str,
        /// How many were given.
        count: usize,
    },
    /// The same key twice in one node's labels or one selector.
    #[error("label key `{0}` is given twice: a key has one value")]
    DuplicateKey(String),
}

/// Checks one zone name, label key or label value: at most
/// [`MAX_NAME_LEN`] bytes of `A-Z a-z 0-9 . _ -`, empty only where
/// `may_be_empty` (a label's value).
///
/// # Errors
/// [`MetaError::Empty`], [`MetaError::TooLong`], [`MetaError::Charset`].
pub fn check_name(what: &'static str, text: &str, may_be_empty: bool) -> Result<(), MetaError> {
    if text.is_empty() && !may_be_empty {
        return Err(MetaError::Empty { what });
    }
    if text.len() > MAX_NAME_LEN {
        let cut = text
            .char_indices()
            .take_while(|&(i, _)| i < 32)
            .map(|(_, c)| c)
            .collect();
        return Err(MetaError::TooLong {
            what,
            text: cut,
            len: text.len(),
        });
    }
    if let Some(bad) = text
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(MetaError::Charset {
            what,
            text: text.to_string(),
            bad,
        });
    }
    Ok(())
}

/// Where a node runs (a data centre, a rack, a cloud zone): 1 to 63 bytes
/// of `A-Z a-z 0-9 . _ -`. getHost prefers nodes of the agent's own zone.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Zone(String);

impl Zone {
    /// The zone's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Zone {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Zone {
    type Err = MetaError;

    /// # Errors
    /// As [`check_name`] for a zone.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        check_name("zone", s, false)?;
        Ok(Zone(s.to_string()))
    }
}

/// One `key=value` label of a node (`version=canary`): a key of 1 to 63
/// bytes and a value of 0 to 63 bytes, both of `A-Z a-z 0-9 . _ -`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label {
    key: String,
    value: String,
}

impl Label {
    /// A label from its key and value.
    ///
    /// # Errors
    /// As [`check_name`] for the key (not empty) and the value.
    pub fn new(key: &str, value: &str) -> Result<Self, MetaError> {
        check_name("label key", key, false)?;
        check_name("label value", value, true)?;
        Ok(Label {
            key: key.to_string(),
            value: value.to_string(),
        })
    }

    /// The label's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The label's value.
    pub fn value(&self) -> &str {
        &self.value
    }
}

impl fmt::Display for Label {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

impl FromStr for Label {
    type Err = MetaError;

    /// Parses `KEY=VALUE`.
    ///
    /// # Errors
    /// [`MetaError::NotKeyValue`] without `=`, else as [`Label::new`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (k, v) = s.split_once('=').ok_or_else(|| {
            MetaError::NotKeyValue(s.chars().take(MAX_NAME_LEN).collect::<String>())
        })?;
        Label::new(k, v)
    }
}

/// A node's labels: at most [`MAX_LABELS`], each key once, kept sorted by
/// key (so two equal sets compare equal whatever order they were given in).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Labels(Vec<Label>);

impl Labels {
    /// Labels from a list.
    ///
    /// # Errors
    /// [`MetaError::TooMany`] past [`MAX_LABELS`], [`MetaError::DuplicateKey`]
    /// for a key given twice.
    pub fn new(mut labels: Vec<Label>) -> Result<Self, MetaError> {
        if labels.len() > MAX_LABELS {
            return Err(MetaError::TooMany {
                what: "labels",
                count: labels.len(),
            });
        }
        labels.sort();
        if let Some(w) = labels.windows(2).find(|w| w[0].key == w[1].key) {
            return Err(MetaError::DuplicateKey(w[0].key.clone()));
        }
        Ok(Labels(labels))
    }

    /// Every label, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = &Label> {
        self.0.iter()
    }

    /// True when there is no label.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The value of `key`, if the node has that label.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|l| l.key.as_str().cmp(key))
            .ok()
            .map(|i| self.0[i].value.as_str())
    }
}

impl fmt::Display for Labels {
    /// `k=v,k2=v2` (empty for none): what [`Labels::from_str`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, l) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{l}")?;
        }
        Ok(())
    }
}

impl FromStr for Labels {
    type Err = MetaError;

    /// Parses `k=v,k2=v2` (empty: no label).
    ///
    /// # Errors
    /// As [`Label::from_str`] for each term, then as [`Labels::new`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.is_empty() {
            return Ok(Labels::default());
        }
        let terms = s.split(',').count();
        if terms > MAX_LABELS {
            return Err(MetaError::TooMany {
                what: "labels",
                count: terms,
            });
        }
        Labels::new(s.split(',').map(str::parse).collect::<Result<_, _>>()?)
    }
}

/// A getHost's label selector: every term `key=value` must be a label of
/// the node (an empty selector matches every node).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Selector(Labels);

impl Selector {
    /// A selector requiring every one of `labels`.
    pub fn new(labels: Labels) -> Self {
        Selector(labels)
    }

    /// True when `node` carries every label of the selector.
    pub fn matches(&self, node: &Labels) -> bool {
        self.0
            .iter()
            .all(|l| node.get(&l.key) == Some(l.value.as_str()))
    }

    /// True for the selector that matches every node.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The terms, sorted by key.
    pub fn terms(&self) -> &Labels {
        &self.0
    }
}

impl FromStr for Selector {
    type Err = MetaError;

    /// Parses `k=v,k2=v2`, as [`Labels::from_str`].
    ///
    /// # Errors
    /// As [`Labels::from_str`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Selector)
    }
}

/// What a route carries of a node beyond its address and weight: its zone
/// and its labels (none of either by default).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct NodeMeta {
    /// The node's zone, if it has one.
    pub zone: Option<Zone>,
    /// The node's labels.
    pub labels: Labels,
}

impl NodeMeta {
    /// True when the node has neither a zone nor a label.
    pub fn is_empty(&self) -> bool {
        self.zone.is_none() && self.labels.is_empty()
    }
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
    fn shard_of_divides_as_the_sum_does() {
        let sums = [0u64, 1, 2, 3, 7, 255, 65_535, 1 << 31, u32::MAX as u64 - 1];
        for shards in [
            1,
            2,
            3,
            5,
            7,
            8,
            24,
            64,
            1000,
            65_537,
            u32::MAX - 1,
            u32::MAX,
        ] {
            let of = ShardOf::new(shards);
            for &s in &sums {
                let m = ModuleId::new(s as u32, 0);
                assert_eq!(of.of(m), m.shard(shards), "{s} % {shards}");
            }
            for (a, b) in [(u32::MAX, 1), (u32::MAX, u32::MAX), (1 << 31, 1 << 31)] {
                let m = ModuleId::new(a, b);
                assert_eq!(of.of(m), m.shard(shards), "({a} + {b}) % {shards}");
            }
        }
        // Every remainder of a few small counts, over a dense range.
        for shards in 1..=17 {
            let of = ShardOf::new(shards);
            for s in (0..100_000u32).chain(u32::MAX - 100_000..=u32::MAX) {
                let m = ModuleId::new(s, 0);
                assert_eq!(of.of(m), s % shards);
            }
        }
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

    #[test]
    fn p2c_is_a_policy_by_name_and_code() {
        assert_eq!("p2c".parse::<Policy>().unwrap(), Policy::P2c);
        assert_eq!(Policy::from_code(Policy::P2c.code()), Some(Policy::P2c));
        assert!("p3c"
            .parse::<Policy>()
            .unwrap_err()
            .to_string()
            .contains("p2c"));
    }

    #[test]
    fn module_options_name_the_option_out_of_range() {
        assert!(ModuleOptions::default().is_unset());
        let bad = ModuleOptions {
            max_overloaded_percent: Some(0),
            ..ModuleOptions::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("max_overloaded_percent"));
        let bad = ModuleOptions {
            panic_percent: Some(101),
            ..ModuleOptions::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("panic_percent"));
        let good = ModuleOptions {
            slow_start_ms: Some(30_000),
            max_overloaded_percent: Some(50),
            panic_percent: Some(50),
            locality_min_percent: Some(70),
        };
        assert_eq!(good.validate(), Ok(()));
    }

    /// The key hash is part of the protocol (clients hash, agents look up):
    /// a new version of the hash crate that changed it would split keys
    /// between old and new clients.
    #[test]
    fn the_key_hash_is_pinned() {
        assert_eq!(key_hash(b"user-42"), 1_584_347_175_418_348_536);
        assert_ne!(key_hash(b""), key_hash(b"\0"));
    }

    #[test]
    fn zones_and_labels_are_bounded_in_length_and_charset() {
        assert_eq!(
            "eu-west_1.a".parse::<Zone>().unwrap().as_str(),
            "eu-west_1.a"
        );
        assert_eq!("".parse::<Zone>(), Err(MetaError::Empty { what: "zone" }));
        assert!(matches!(
            "a".repeat(64).parse::<Zone>(),
            Err(MetaError::TooLong { len: 64, .. })
        ));
        assert!("a".repeat(63).parse::<Zone>().is_ok());
        assert!(matches!(
            "eu west".parse::<Zone>(),
            Err(MetaError::Charset { bad: ' ', .. })
        ));
        assert!(matches!(
            "zoné".parse::<Zone>(),
            Err(MetaError::Charset { bad: 'é', .. })
        ));
        assert!(matches!(
            "version".parse::<Label>(),
            Err(MetaError::NotKeyValue(_))
        ));
        assert!(matches!(
            "=canary".parse::<Label>(),
            Err(MetaError::Empty { what: "label key" })
        ));
        assert_eq!("flag=".parse::<Label>().unwrap().value(), "");
        assert!(matches!(
            "k=a,b".parse::<Label>(),
            Err(MetaError::Charset { bad: ',', .. })
        ));
    }

    #[test]
    fn labels_are_sorted_unique_and_at_most_sixteen() {
        let l: Labels = "version=canary,az=b".parse().unwrap();
        assert_eq!(l.to_string(), "az=b,version=canary");
        assert_eq!(l.get("version"), Some("canary"));
        assert_eq!(l.get("other"), None);
        assert_eq!(l.to_string().parse::<Labels>().unwrap(), l);
        assert_eq!(
            "a=1,a=2".parse::<Labels>(),
            Err(MetaError::DuplicateKey("a".into()))
        );
        let many: Vec<String> = (0..17).map(|i| format!("k{i}=v")).collect();
        assert_eq!(
            many.join(",").parse::<Labels>(),
            Err(MetaError::TooMany {
                what: "labels",
                count: 17
            })
        );
        assert!(many[..16].join(",").parse::<Labels>().is_ok());
        assert!("".parse::<Labels>().unwrap().is_empty());
    }

    #[test]
    fn a_selector_matches_nodes_carrying_every_term() {
        let node: Labels = "version=canary,az=b".parse().unwrap();
        let yes: Selector = "version=canary".parse().unwrap();
        let both: Selector = "az=b,version=canary".parse().unwrap();
        let no: Selector = "version=stable".parse().unwrap();
        let missing: Selector = "tier=gold".parse().unwrap();
        assert!(yes.matches(&node) && both.matches(&node));
        assert!(!no.matches(&node) && !missing.matches(&node));
        assert!(Selector::default().matches(&Labels::default()));
        assert!(!yes.matches(&Labels::default()));
    }
}
