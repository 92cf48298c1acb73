//! Label selectors on getHost (canary and metadata routing), pure: what a
//! getHost with a selector answers when no node matches.
//!
//! A getHost with a selector chooses, with the module's policy, among the
//! idle nodes whose labels carry every term of the selector
//! ([`lbagent_model::Selector::matches`]). When some node matches but
//! every matching one is overloaded, the answer is the module's usual
//! "overloaded" (the selector is a constraint, not a preference). When no
//! node of the route matches at all, [`Fallback`] says what happens.
//!
//! It must not touch: node state, clocks, sockets.

use std::fmt;
use std::str::FromStr;

/// What a getHost whose selector matches no node of the route answers
/// (`[lb] label_fallback`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Fallback {
    /// Choose among every node as if there were no selector (the default:
    /// a selector naming a canary that is not deployed reaches the rest).
    #[default]
    Any,
    /// Answer that no node matches ([`NoMatch`]).
    Fail,
}

impl Fallback {
    /// The name: `any` or `fail`.
    pub fn as_str(self) -> &'static str {
        match self {
            Fallback::Any => "any",
            Fallback::Fail => "fail",
        }
    }
}

impl fmt::Display for Fallback {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A fallback name that is neither `any` nor `fail`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("label fallback {0:?} is not one of any, fail")]
pub struct ParseFallbackError(pub String);

impl FromStr for Fallback {
    type Err = ParseFallbackError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "any" => Ok(Fallback::Any),
            "fail" => Ok(Fallback::Fail),
            _ => Err(ParseFallbackError(s.to_string())),
        }
    }
}

/// No node of the module's route carries the selector's labels, and the
/// fallback is [`Fallback::Fail`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("no node of the module carries the selector's labels: check the selector, or add labelled nodes (lbagent route add --label)")]
pub struct NoMatch;

/// What a getHost with a selector does, from what the route holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Choose among the idle matching nodes (overloaded if none is idle).
    Matching,
    /// Choose among every node, as without a selector.
    Everyone,
}

/// The plan for a selector of which `matching` nodes of the route match
/// (idle or not), under `fallback`.
///
/// # Errors
/// [`NoMatch`] when none matches and the fallback is [`Fallback::Fail`].
pub fn plan(matching: usize, fallback: Fallback) -> Result<Plan, NoMatch> {
    match (matching, fallback) {
        (0, Fallback::Any) => Ok(Plan::Everyone),
        (0, Fallback::Fail) => Err(NoMatch),
        _ => Ok(Plan::Matching),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selector_that_matches_some_node_is_a_constraint() {
        assert_eq!(plan(1, Fallback::Any), Ok(Plan::Matching));
        assert_eq!(plan(3, Fallback::Fail), Ok(Plan::Matching));
    }

    #[test]
    fn no_match_falls_back_as_configured() {
        assert_eq!(plan(0, Fallback::Any), Ok(Plan::Everyone));
        assert_eq!(plan(0, Fallback::Fail), Err(NoMatch));
    }

    #[test]
    fn fallback_names_parse_and_print() {
        for f in [Fallback::Any, Fallback::Fail] {
            assert_eq!(f.as_str().parse::<Fallback>(), Ok(f));
        }
        assert_eq!(Fallback::default(), Fallback::Any);
        assert!("none".parse::<Fallback>().is_err());
    }
}
