//! AFL target: [`lbagent_fuzz::config`].

fn main() {
    afl::fuzz!(|data: &[u8]| {
        lbagent_fuzz::config(data);
    });
}
