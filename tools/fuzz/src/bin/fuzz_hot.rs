//! AFL target: [`lbagent_fuzz::hot`].

fn main() {
    afl::fuzz!(|data: &[u8]| {
        lbagent_fuzz::hot(data);
    });
}
