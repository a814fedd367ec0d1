fn main() { println!("{}", kvsim::mlx_version()); }
