//! AFL target: [`lbagent_fuzz::heartbeat`].

fn main() {
    afl::fuzz!(|data: &[u8]| {
        lbagent_fuzz::heartbeat(data);
    });
}
