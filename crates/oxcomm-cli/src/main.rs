fn main() {
    println!("oxcomm");
}
