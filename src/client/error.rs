//! The one error type of the client library: what went wrong with a call,
//! typed so that an application can act on it, and worded so that an
//! operator reading it knows what to do.

use std::time::Duration;

use lbagent_model::ModuleId;

/// Why a call of the client library failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The agent has no route for the module: the route server does not
    /// know it, or the agent is still pulling it (call
    /// [`super::Client::register`] before first use).
    #[error(
        "no such module {module}: the agent has no route for it (the route server does not know it, \
         or the route is still being pulled: call register first, or add it with `lbagent route add`)"
    )]
    NoSuchModule {
        /// The module asked for.
        module: ModuleId,
    },
    /// Every node of the module is overloaded and no probe was due.
    #[error("module {module} is overloaded: every node is overloaded; back off and retry later")]
    Overloaded {
        /// The module asked for.
        module: ModuleId,
    },
    /// The agent's admission control (DAGOR) shed the request for its
    /// priority.
    #[error(
        "module {module}: the agent's admission control rejected the request for its priority; \
         retry later or raise the business / user priority"
    )]
    Rejected {
        /// The module asked for.
        module: ModuleId,
    },
    /// The agent is down (heartbeat missing, unreadable or stale, or its
    /// port refuses datagrams) and the call has no static answer: static
    /// fallback is off, or the call is not a getHost.
    #[error("the local agent is down: {0}")]
    AgentDown(String),
    /// The agent is down and the static route file cannot answer: it is
    /// missing, truncated or corrupt, or has no node of the module.
    #[error("the local agent is down and the static route file cannot answer: {0}")]
    StaticRoutes(String),
    /// No answer from the agent within the caller's timeout, although the
    /// request was re-sent (and, for getHost, no static answer either).
    #[error(
        "no answer from the agent for module {module} within {} ms: it is stalled or overloaded \
         (check `lbagent getroute` and its metrics), or raise the timeout",
        waited.as_millis()
    )]
    Timeout {
        /// The module asked for.
        module: ModuleId,
        /// How long the call waited.
        waited: Duration,
    },
    /// The agent's port answered with something that is not a valid answer
    /// to the request: undecodable bytes, a message of the wrong kind, or an
    /// answer about another module. Is something else listening there?
    #[error("bad response from the agent: {0}")]
    BadResponse(String),
    /// An argument is invalid (checked before anything is sent), or the
    /// agent refused the request as invalid.
    #[error("bad request: {0}")]
    BadRequest(String),
}

impl ClientError {
    /// A stable short name for logs, counters and JSON: `no_such_module`,
    /// `overloaded`, `rejected`, `agent_down`, `static_routes`, `timeout`,
    /// `bad_response` or `bad_request`.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::NoSuchModule { .. } => "no_such_module",
            ClientError::Overloaded { .. } => "overloaded",
            ClientError::Rejected { .. } => "rejected",
            ClientError::AgentDown(_) => "agent_down",
            ClientError::StaticRoutes(_) => "static_routes",
            ClientError::Timeout { .. } => "timeout",
            ClientError::BadResponse(_) => "bad_response",
            ClientError::BadRequest(_) => "bad_request",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_distinct_and_messages_say_what_to_do() {
        let m = ModuleId::new(1, 2);
        let all = [
            ClientError::NoSuchModule { module: m },
            ClientError::Overloaded { module: m },
            ClientError::Rejected { module: m },
            ClientError::AgentDown("x".into()),
            ClientError::StaticRoutes("x".into()),
            ClientError::Timeout {
                module: m,
                waited: Duration::from_millis(250),
            },
            ClientError::BadResponse("x".into()),
            ClientError::BadRequest("x".into()),
        ];
        let mut kinds: Vec<&str> = all.iter().map(ClientError::kind).collect();
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), all.len());
        assert!(all[0].to_string().contains("[1, 2]"));
        assert!(all[5].to_string().contains("250 ms"), "{}", all[5]);
    }
}
