//! AFL target: [`lbagent_fuzz::frame`].

fn main() {
    afl::fuzz!(|data: &[u8]| {
        lbagent_fuzz::frame(data);
    });
}
