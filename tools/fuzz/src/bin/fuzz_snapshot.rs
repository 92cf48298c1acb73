//! AFL target: [`lbagent_fuzz::snapshot`].

fn main() {
    afl::fuzz!(|data: &[u8]| {
        lbagent_fuzz::snapshot(data);
    });
}
