//! Field rules the verifier cannot know: a verified buffer can still name a
//! node with port 0 or ask to wait forever. Each request table whose fields
//! matter gets a `validate()` returning plain values or a
//! [`ValidationError`]; the caller answers that with an ErrorResp
//! (BadRequest) or drops it.

use flatbuffers::Vector;

use super::fb;
use super::values::{AdmissionLevel, Report};
use lbagent_model::{ModuleId, NodeAddr};

/// The largest DAGOR priority or admission level part (1 = most important).
pub const MAX_PRIORITY: u8 = 128;

/// The longest a RegisterReq may ask the agent to wait, in milliseconds.
pub const MAX_REGISTER_TIMEOUT_MS: u32 = 60_000;

/// The most modules one PullReq may name.
pub const MAX_PULL_MODULES: usize = 65_536;

/// The most capacity units one report may say it consumed for good (the
/// store's largest weight).
pub const MAX_CONSUMED: u32 = 1_000_000;

/// Why a verified request's fields are not acceptable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// The request names no node.
    #[error("host is missing")]
    MissingHost,
    /// The request names a node with port 0, which is no service.
    #[error("host {0} has port 0")]
    PortZero(NodeAddr),
    /// A DAGOR priority is above [`MAX_PRIORITY`].
    #[error("priority out of range: business {business}, user {user} (each 0 = unset or 1..=128)")]
    PriorityOutOfRange {
        /// The business priority sent.
        business: u8,
        /// The user priority sent.
        user: u8,
    },
    /// An admission level is neither none (0, 0) nor in 1..=128 in both parts.
    #[error("admission level out of range: ({business}, {user}) (each 1..=128, or both 0 = none)")]
    LevelOutOfRange {
        /// The business part sent.
        business: u8,
        /// The user part sent.
        user: u8,
    },
    /// A report's consumed units above [`MAX_CONSUMED`].
    #[error("consumed {0} units is out of range: at most 1000000")]
    ConsumedOutOfRange(u32),
    /// A RegisterReq timeout of 0 or above [`MAX_REGISTER_TIMEOUT_MS`].
    #[error("timeout_ms {0} out of range 1..=60000")]
    TimeoutOutOfRange(u32),
    /// A PullReq naming no module.
    #[error("pull request names no module")]
    NoModules,
    /// A PullReq naming more than [`MAX_PULL_MODULES`] modules.
    #[error("pull request names {count} modules, more than the {max} allowed")]
    TooManyModules {
        /// How many it names.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A PullReq's `known_versions`, or a RouteUnchanged's `versions`, has
    /// not one entry per module.
    #[error("{modules} modules but {versions} versions: send one version per module")]
    VersionCount {
        /// How many modules it names.
        modules: usize,
        /// How many versions it carries.
        versions: usize,
    },
}

/// A validated GetHostReq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GetHost {
    /// Request sequence number, to echo.
    pub seq: u32,
    /// The module asked for (absent ids read as 0).
    pub module: ModuleId,
    /// DAGOR business priority, 0 (unset) or 1..=128.
    pub business_priority: u8,
    /// DAGOR user priority, 0 (unset) or 1..=128.
    pub user_priority: u8,
}

/// A validated BatchReportReq: every host has a port.
#[derive(Clone, Copy, Debug)]
pub struct BatchReport<'a> {
    /// Request sequence number.
    pub seq: u32,
    /// The module called.
    pub module: ModuleId,
    successes: Option<Vector<'a, fb::HostCount>>,
}

impl<'a> BatchReport<'a> {
    /// Each node with its count of successful calls, in message order.
    pub fn successes(&self) -> impl ExactSizeIterator<Item = (NodeAddr, u32)> + 'a {
        let v = self.successes.unwrap_or_default();
        v.iter().map(|s| (NodeAddr::from(s.host()), s.count()))
    }
}

/// A validated RegisterReq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Register {
    /// Request sequence number, to echo.
    pub seq: u32,
    /// The module to pull.
    pub module: ModuleId,
    /// How long to wait for the route, 1..=[`MAX_REGISTER_TIMEOUT_MS`].
    pub timeout_ms: u32,
}

/// A validated PullReq: 1..=[`MAX_PULL_MODULES`] modules, and, when
/// `known_versions` is present, one version per module.
#[derive(Clone, Copy, Debug)]
pub struct Pull<'a> {
    /// Request sequence number, echoed by every RouteAnswer.
    pub seq: u64,
    modules: Vector<'a, fb::ModuleId>,
    known: Option<Vector<'a, u64>>,
}

impl<'a> Pull<'a> {
    /// The modules asked for, in message order (never empty).
    pub fn modules(&self) -> impl ExactSizeIterator<Item = ModuleId> + 'a {
        self.modules.iter().map(ModuleId::from)
    }

    /// Whether the agent sent the versions it holds (a peer that predates
    /// `known_versions` does not).
    pub fn carries_versions(&self) -> bool {
        self.known.is_some()
    }

    /// Each module with the version the agent holds (`None`: the request
    /// carries no versions; `Some(0)`: the agent holds none).
    pub fn modules_known(&self) -> impl ExactSizeIterator<Item = (ModuleId, Option<u64>)> + 'a {
        let known = self.known;
        self.modules
            .iter()
            .enumerate()
            .map(move |(i, m)| (ModuleId::from(m), known.map(|k| k.get(i))))
    }
}

/// A validated RouteUnchanged: as many versions as modules, at most
/// [`MAX_PULL_MODULES`].
#[derive(Clone, Copy, Debug)]
pub struct Unchanged<'a> {
    /// The PullReq answered.
    pub seq: u64,
    modules: Option<Vector<'a, fb::ModuleId>>,
    versions: Option<Vector<'a, u64>>,
}

impl<'a> Unchanged<'a> {
    /// Each module with the version it is unchanged at, in message order.
    pub fn modules(&self) -> impl ExactSizeIterator<Item = (ModuleId, u64)> + 'a {
        let (modules, versions) = (self.modules.unwrap_or_default(), self.versions);
        modules
            .iter()
            .enumerate()
            .map(move |(i, m)| (ModuleId::from(m), versions.map_or(0, |v| v.get(i))))
    }
}

fn host(h: Option<&fb::Host>) -> Result<NodeAddr, ValidationError> {
    let addr = NodeAddr::from(h.ok_or(ValidationError::MissingHost)?);
    if addr.port == 0 {
        return Err(ValidationError::PortZero(addr));
    }
    Ok(addr)
}

fn level(l: Option<&fb::AdmissionLevel>) -> Result<Option<AdmissionLevel>, ValidationError> {
    let Some(l) = AdmissionLevel::from_wire(l) else {
        return Ok(None);
    };
    let part_ok = |p: u8| (1..=MAX_PRIORITY).contains(&p);
    if part_ok(l.business) && part_ok(l.user) {
        Ok(Some(l))
    } else {
        Err(ValidationError::LevelOutOfRange {
            business: l.business,
            user: l.user,
        })
    }
}

// === the rules, shared by validate() and the hot path's reader ===

/// A getHost's values with its priorities checked: what
/// [`fb::GetHostReq::validate`] and the hot path ([`super::hot`]) return.
pub(crate) fn get_host_values(
    seq: u32,
    modid: u32,
    cmdid: u32,
    business: u8,
    user: u8,
) -> Result<GetHost, ValidationError> {
    if business > MAX_PRIORITY || user > MAX_PRIORITY {
        return Err(ValidationError::PriorityOutOfRange { business, user });
    }
    Ok(GetHost {
        seq,
        module: ModuleId::new(modid, cmdid),
        business_priority: business,
        user_priority: user,
    })
}

/// A report's fields as read from a buffer (absent ones at their defaults).
pub(crate) struct ReportFields<'a> {
    pub seq: u32,
    pub modid: u32,
    pub cmdid: u32,
    pub host: Option<&'a fb::Host>,
    pub retcode: i32,
    pub tcost_ms: u32,
    pub level: Option<&'a fb::AdmissionLevel>,
    pub consumed: u32,
}

/// A report's values with its host, level and consumed units checked, in
/// that order: what [`fb::ReportReq::validate`] and the hot path
/// ([`super::hot`]) return.
pub(crate) fn report_values(f: ReportFields<'_>) -> Result<Report, ValidationError> {
    Ok(Report {
        seq: f.seq,
        module: ModuleId::new(f.modid, f.cmdid),
        host: host(f.host)?,
        retcode: f.retcode,
        tcost_ms: f.tcost_ms,
        downstream_level: level(f.level)?,
        consumed: match f.consumed {
            c if c > MAX_CONSUMED => return Err(ValidationError::ConsumedOutOfRange(c)),
            c => c,
        },
    })
}

// === impl validate() on the generated request tables ===

impl fb::GetHostReq<'_> {
    /// The request's values, with its priorities checked.
    ///
    /// # Errors
    /// [`ValidationError::PriorityOutOfRange`] when a priority is above 128.
    pub fn validate(&self) -> Result<GetHost, ValidationError> {
        get_host_values(
            self.seq(),
            self.modid(),
            self.cmdid(),
            self.business_priority(),
            self.user_priority(),
        )
    }

    /// False for a plain getHost, which carries neither a key's hash nor
    /// a selector: its vtable ends before their slots (a FlatBuffers
    /// builder writes a table's vtable only up to its last field
    /// present). One comparison on the verified vtable, so a plain
    /// getHost looks neither field up; true does not mean either is
    /// there ([`fb::GetHostReq::key_hash`] and
    /// [`fb::GetHostReq::selector`] say).
    #[inline]
    pub fn may_steer(&self) -> bool {
        self._tab.vtable().num_bytes() > usize::from(fb::GetHostReq::VT_KEY_HASH)
    }
}

impl fb::ReportReq<'_> {
    /// The report's values, with its host and admission level checked.
    ///
    /// # Errors
    /// [`ValidationError::MissingHost`], [`ValidationError::PortZero`],
    /// [`ValidationError::LevelOutOfRange`],
    /// [`ValidationError::ConsumedOutOfRange`].
    pub fn validate(&self) -> Result<Report, ValidationError> {
        report_values(ReportFields {
            seq: self.seq(),
            modid: self.modid(),
            cmdid: self.cmdid(),
            host: self.host(),
            retcode: self.retcode(),
            tcost_ms: self.tcost_ms(),
            level: self.downstream_level(),
            consumed: self.consumed(),
        })
    }
}

impl<'a> fb::BatchReportReq<'a> {
    /// The batch, with every host checked (an absent list is an empty batch).
    ///
    /// # Errors
    /// [`ValidationError::PortZero`] for the first host with port 0.
    pub fn validate(&self) -> Result<BatchReport<'a>, ValidationError> {
        let successes = self.successes();
        for s in successes.iter().flatten() {
            host(Some(s.host()))?;
        }
        Ok(BatchReport {
            seq: self.seq(),
            module: ModuleId::new(self.modid(), self.cmdid()),
            successes,
        })
    }
}

impl fb::RegisterReq<'_> {
    /// The request's values, with its timeout checked.
    ///
    /// # Errors
    /// [`ValidationError::TimeoutOutOfRange`] for 0 or above
    /// [`MAX_REGISTER_TIMEOUT_MS`].
    pub fn validate(&self) -> Result<Register, ValidationError> {
        let timeout_ms = self.timeout_ms();
        if !(1..=MAX_REGISTER_TIMEOUT_MS).contains(&timeout_ms) {
            return Err(ValidationError::TimeoutOutOfRange(timeout_ms));
        }
        Ok(Register {
            seq: self.seq(),
            module: ModuleId::new(self.modid(), self.cmdid()),
            timeout_ms,
        })
    }
}

impl<'a> fb::PullReq<'a> {
    /// The request, with its module list checked.
    ///
    /// # Errors
    /// [`ValidationError::NoModules`] for an absent or empty list,
    /// [`ValidationError::TooManyModules`] above [`MAX_PULL_MODULES`].
    pub fn validate(&self) -> Result<Pull<'a>, ValidationError> {
        let modules = self.modules().unwrap_or_default();
        match modules.len() {
            0 => Err(ValidationError::NoModules),
            count if count > MAX_PULL_MODULES => Err(ValidationError::TooManyModules {
                count,
                max: MAX_PULL_MODULES,
            }),
            count => match self.known_versions() {
                Some(known) if known.len() != count => Err(ValidationError::VersionCount {
                    modules: count,
                    versions: known.len(),
                }),
                known => Ok(Pull {
                    seq: self.seq(),
                    modules,
                    known,
                }),
            },
        }
    }
}

impl<'a> fb::RouteUnchanged<'a> {
    /// The answer, with its vectors checked.
    ///
    /// # Errors
    /// [`ValidationError::VersionCount`] when the two vectors differ in
    /// length, [`ValidationError::TooManyModules`] above [`MAX_PULL_MODULES`].
    pub fn validate(&self) -> Result<Unchanged<'a>, ValidationError> {
        let (modules, versions) = (self.modules(), self.versions());
        let count = modules.map_or(0, |m| m.len());
        let vcount = versions.map_or(0, |v| v.len());
        if count != vcount {
            return Err(ValidationError::VersionCount {
                modules: count,
                versions: vcount,
            });
        }
        if count > MAX_PULL_MODULES {
            return Err(ValidationError::TooManyModules {
                count,
                max: MAX_PULL_MODULES,
            });
        }
        Ok(Unchanged {
            seq: self.seq(),
            modules,
            versions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{decode, Encoder, Limits, Message};
    use flatbuffers::FlatBufferBuilder;

    const M: ModuleId = ModuleId::new(1, 2);
    const HOST: NodeAddr = NodeAddr {
        ip: 0x7f00_0001,
        port: 8080,
    };

    fn report(host: NodeAddr, level: Option<AdmissionLevel>) -> Report {
        Report {
            seq: 1,
            module: M,
            host,
            retcode: 0,
            tcost_ms: 5,
            downstream_level: level,
            consumed: 0,
        }
    }

    fn validate_report(buf: &[u8]) -> Result<Report, ValidationError> {
        match decode(buf, &Limits::UDP).unwrap() {
            Message::ReportReq(m) => m.validate(),
            other => panic!("decoded {}", other.name()),
        }
    }

    #[test]
    fn a_report_without_a_host_is_refused() {
        let mut fbb = FlatBufferBuilder::new();
        let args = fb::ReportReqArgs {
            seq: 1,
            ..Default::default()
        };
        let body = fb::ReportReq::create(&mut fbb, &args).as_union_value();
        let args = fb::EnvelopeArgs {
            body_type: fb::Body::ReportReq,
            body: Some(body),
        };
        let root = fb::Envelope::create(&mut fbb, &args);
        fb::finish_envelope_buffer(&mut fbb, root);
        assert_eq!(
            validate_report(fbb.finished_data()),
            Err(ValidationError::MissingHost)
        );
    }

    #[test]
    fn a_report_for_port_zero_is_refused() {
        let zero = NodeAddr { port: 0, ..HOST };
        let mut enc = Encoder::new();
        let err = validate_report(enc.report_req(&report(zero, None)));
        assert_eq!(err, Err(ValidationError::PortZero(zero)));
        assert_eq!(err.unwrap_err().to_string(), "host 127.0.0.1:0 has port 0");
    }

    #[test]
    fn a_downstream_level_must_be_none_or_in_range() {
        let mut enc = Encoder::new();
        let none = AdmissionLevel::new(0, 0);
        let ok = validate_report(enc.report_req(&report(HOST, Some(none)))).unwrap();
        assert_eq!(ok.downstream_level, None, "(0, 0) is no level");
        for (b, u) in [(0, 1), (129, 1), (1, 255)] {
            let level = Some(AdmissionLevel::new(b, u));
            let err = validate_report(enc.report_req(&report(HOST, level)));
            assert_eq!(
                err,
                Err(ValidationError::LevelOutOfRange {
                    business: b,
                    user: u
                })
            );
        }
    }

    #[test]
    fn a_batch_with_a_port_zero_host_is_refused() {
        let zero = NodeAddr { port: 0, ..HOST };
        let mut enc = Encoder::new();
        let buf = enc.batch_report_req(1, M, &[(HOST, 1), (zero, 2)]);
        let Ok(Message::BatchReportReq(m)) = decode(buf, &Limits::UDP) else {
            panic!("wrong type")
        };
        assert_eq!(m.validate().unwrap_err(), ValidationError::PortZero(zero));

        let buf = enc.batch_report_req(1, M, &[]);
        let Ok(Message::BatchReportReq(m)) = decode(buf, &Limits::UDP) else {
            panic!("wrong type")
        };
        assert_eq!(m.validate().unwrap().successes().len(), 0, "empty is fine");
    }

    #[test]
    fn get_host_priorities_above_128_are_refused() {
        let mut enc = Encoder::new();
        for (b, u, ok) in [
            (0, 0, true),
            (128, 1, true),
            (129, 1, false),
            (1, 200, false),
        ] {
            let Ok(Message::GetHostReq(m)) = decode(enc.get_host_req(1, M, b, u), &Limits::UDP)
            else {
                panic!("wrong type")
            };
            let expected = if ok {
                Ok(GetHost {
                    seq: 1,
                    module: M,
                    business_priority: b,
                    user_priority: u,
                })
            } else {
                Err(ValidationError::PriorityOutOfRange {
                    business: b,
                    user: u,
                })
            };
            assert_eq!(m.validate(), expected);
        }
    }

    #[test]
    fn a_register_timeout_must_be_in_range() {
        let mut enc = Encoder::new();
        for (t, ok) in [
            (0, false),
            (1, true),
            (60_000, true),
            (60_001, false),
            (u32::MAX, false),
        ] {
            let Ok(Message::RegisterReq(m)) = decode(enc.register_req(1, M, t), &Limits::UDP)
            else {
                panic!("wrong type")
            };
            let expected = if ok {
                Ok(Register {
                    seq: 1,
                    module: M,
                    timeout_ms: t,
                })
            } else {
                Err(ValidationError::TimeoutOutOfRange(t))
            };
            assert_eq!(m.validate(), expected);
        }
    }

    #[test]
    fn a_pull_must_name_modules_but_not_too_many() {
        let mut enc = Encoder::new();
        let Ok(Message::PullReq(m)) = decode(enc.pull_req(1, &[]), &Limits::TCP_FRAME) else {
            panic!("wrong type")
        };
        assert_eq!(m.validate().unwrap_err(), ValidationError::NoModules);

        let many = vec![M; MAX_PULL_MODULES + 1];
        let Ok(Message::PullReq(m)) = decode(enc.pull_req(1, &many), &Limits::TCP_FRAME) else {
            panic!("wrong type")
        };
        let err = m.validate().unwrap_err();
        assert_eq!(
            err,
            ValidationError::TooManyModules {
                count: MAX_PULL_MODULES + 1,
                max: MAX_PULL_MODULES
            }
        );

        let Ok(Message::PullReq(m)) = decode(enc.pull_req(1, &many[1..]), &Limits::TCP_FRAME)
        else {
            panic!("wrong type")
        };
        assert_eq!(m.validate().unwrap().modules().len(), MAX_PULL_MODULES);
    }

    #[test]
    fn a_pull_carries_one_known_version_per_module_or_none() {
        let mut enc = Encoder::new();
        let other = ModuleId::new(8, 9);
        let Ok(Message::PullReq(m)) = decode(enc.pull_req(1, &[M, other]), &Limits::TCP_FRAME)
        else {
            panic!("wrong type")
        };
        let pull = m.validate().unwrap();
        assert!(!pull.carries_versions(), "an old peer's pull");
        assert_eq!(
            pull.modules_known().collect::<Vec<_>>(),
            vec![(M, None), (other, None)]
        );
        let buf = enc.pull_req_known(2, &[M, other], &[7, 0]).to_vec();
        let Ok(Message::PullReq(m)) = decode(&buf, &Limits::TCP_FRAME) else {
            panic!("wrong type")
        };
        let pull = m.validate().unwrap();
        assert!(pull.carries_versions());
        assert_eq!(
            pull.modules_known().collect::<Vec<_>>(),
            vec![(M, Some(7)), (other, Some(0))]
        );
    }

    #[test]
    fn a_version_count_that_is_not_the_module_count_is_refused() {
        let mut fbb = FlatBufferBuilder::new();
        let modules = fbb.create_vector(&[fb::ModuleId::from(M), fb::ModuleId::from(M)]);
        let known_versions = fbb.create_vector(&[1u64]);
        let args = fb::PullReqArgs {
            seq: 3,
            modules: Some(modules),
            known_versions: Some(known_versions),
        };
        let body = fb::PullReq::create(&mut fbb, &args).as_union_value();
        let env = fb::Envelope::create(
            &mut fbb,
            &fb::EnvelopeArgs {
                body_type: fb::Body::PullReq,
                body: Some(body),
            },
        );
        fb::finish_envelope_buffer(&mut fbb, env);
        let Ok(Message::PullReq(m)) = decode(fbb.finished_data(), &Limits::TCP_FRAME) else {
            panic!("wrong type")
        };
        let err = m.validate().unwrap_err();
        assert_eq!(
            err,
            ValidationError::VersionCount {
                modules: 2,
                versions: 1
            }
        );
        assert!(err.to_string().contains("one version per module"));
    }

    #[test]
    fn an_unchanged_answer_pairs_modules_with_versions() {
        let mut enc = Encoder::new();
        let other = ModuleId::new(8, 9);
        let buf = enc.route_unchanged(5, &[M, other], &[3, 4]).to_vec();
        let Ok(Message::RouteUnchanged(m)) = decode(&buf, &Limits::TCP_FRAME) else {
            panic!("wrong type")
        };
        let u = m.validate().unwrap();
        assert_eq!(u.seq, 5);
        assert_eq!(u.modules().collect::<Vec<_>>(), vec![(M, 3), (other, 4)]);
        // No node crosses the wire: 16 bytes per module, beyond the envelope.
        let many: Vec<ModuleId> = (0..100).map(|i| ModuleId::new(i, 0)).collect();
        let len = enc.route_unchanged(6, &many, &[7; 100]).len();
        assert!(len <= 100 * 16 + 128, "{len} bytes for 100 modules");
    }
}
