//! SQL text helpers the engines share where they inline values.

/// Appends the hex form of `bytes` to `out`, two digits a byte: encoded a
/// chunk at a time on the stack from a table of digit pairs, then appended
/// whole: every claim and finish writes its values through here.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const CHUNK: usize = 512;
    const PAIRS: [[u8; 2]; 256] = {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut pairs = [[0; 2]; 256];
        let mut byte = 0;
        while byte < 256 {
            pairs[byte] = [DIGITS[byte >> 4], DIGITS[byte & 0xf]];
            byte += 1;
        }
        pairs
    };
    let mut digits = [0_u8; 2 * CHUNK];
    out.reserve(bytes.len() * 2);
    for chunk in bytes.chunks(CHUNK) {
        let digits = &mut digits[..2 * chunk.len()];
        for (pair, &byte) in digits.chunks_exact_mut(2).zip(chunk) {
            pair.copy_from_slice(&PAIRS[usize::from(byte)]);
        }
        out.push_str(std::str::from_utf8(digits).expect("hex digits are ASCII"));
    }
}

#[cfg(test)]
mod tests {
    /// Every length, across the chunk boundaries, gives the plain hex form.
    #[test]
    fn push_hex_appends_lowercase_digits_across_chunks() {
        let bytes: Vec<u8> = (0..=255).cycle().take(1500).collect();
        for len in [0, 1, 255, 511, 512, 513, 1024, 1500] {
            let mut out = String::from("x");
            super::push_hex(&mut out, &bytes[..len]);
            assert_eq!(
                out,
                format!("x{}", hex::encode(&bytes[..len])),
                "{len} bytes"
            );
        }
    }
}
