//! The exit status of the tool commands (`lbagent gethost`, `report`,
//! `getroute`) for each [`ClientError`], shared with the C ABI, whose error
//! codes are the same numbers.
//!
//! | code | meaning |
//! |---:|---|
//! | 0 | success |
//! | 3 | no such module: the agent has no route for it |
//! | 4 | module overloaded: every node is overloaded |
//! | 5 | rejected by the agent's admission control |
//! | 6 | agent down: no fresh heartbeat, or its port refuses datagrams |
//! | 7 | agent down and the static route file cannot answer (gethost) |
//! | 8 | timeout: the agent did not answer in `--timeout-ms` |
//! | 9 | bad response: something that is not the agent answered |
//! | 10 | bad argument, or a request the agent refused |
//! | 78 | the configuration given with `--config` is invalid |

use crate::ClientError;

/// Exit status: success.
pub const EXIT_OK: u8 = 0;
/// Exit status: `lbagent gethost --config FILE` cannot be read or is
/// invalid (the binary's "configuration invalid", sysexits EX_CONFIG).
pub const EXIT_CONFIG: u8 = 78;
/// Exit status: the agent has no route for the module.
pub const EXIT_NO_SUCH_MODULE: u8 = 3;
/// Exit status: every node of the module is overloaded.
pub const EXIT_OVERLOADED: u8 = 4;
/// Exit status: the agent's admission control rejected the request.
pub const EXIT_REJECTED: u8 = 5;
/// Exit status: the agent is down.
pub const EXIT_AGENT_DOWN: u8 = 6;
/// Exit status: the agent is down and the static route file cannot answer.
pub const EXIT_STATIC_ROUTES: u8 = 7;
/// Exit status: the agent did not answer in time.
pub const EXIT_TIMEOUT: u8 = 8;
/// Exit status: the answer was not a valid answer.
pub const EXIT_BAD_RESPONSE: u8 = 9;
/// Exit status: a bad argument, or a request the agent refused.
pub const EXIT_BAD_ARGUMENT: u8 = 10;

/// The exit status for an error (see the module documentation).
pub fn exit_code(e: &ClientError) -> u8 {
    match e {
        ClientError::NoSuchModule { .. } => EXIT_NO_SUCH_MODULE,
        ClientError::Overloaded { .. } => EXIT_OVERLOADED,
        ClientError::Rejected { .. } => EXIT_REJECTED,
        ClientError::AgentDown(_) => EXIT_AGENT_DOWN,
        ClientError::StaticRoutes(_) => EXIT_STATIC_ROUTES,
        ClientError::Timeout { .. } => EXIT_TIMEOUT,
        ClientError::BadResponse(_) => EXIT_BAD_RESPONSE,
        ClientError::BadRequest(_) => EXIT_BAD_ARGUMENT,
    }
}
