//! AFL target: [`lbagent_fuzz::datagram`].

fn main() {
    afl::fuzz!(|data: &[u8]| {
        lbagent_fuzz::datagram(data);
    });
}
