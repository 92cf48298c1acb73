//! Writes every target's starting corpus: `seeds DIR` fills `DIR/TARGET/`.

fn main() {
    let Some(dir) = std::env::args_os().nth(1) else {
        eprintln!("usage: seeds DIR");
        std::process::exit(2);
    };
    if let Err(e) = lbagent_fuzz::seeds::write_all(std::path::Path::new(&dir)) {
        eprintln!("seeds: {e}");
        std::process::exit(1);
    }
}
