// kvcache tier: SHA-256 (FIPS 180-4), written out from the standard, for the keys of
// entries that leave the process (tier/key.hpp). Reproducible across processes,
// machines and library versions; checked against the NIST test vectors (tests/tier).
// Not constant-time, not for secrets: it names cache entries.
#pragma once

#include <array>        // digest
#include <cstddef>      // std::byte, std::size_t
#include <cstdint>      // fixed-width integers
#include <cstring>      // std::memcpy
#include <span>         // input
#include <string>       // hex
#include <string_view>  // input

#include "../config.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

/// A SHA-256 digest (32 bytes, big-endian words as the standard writes them).
using sha256_digest = std::array<std::uint8_t, 32>;

/// Incremental SHA-256: update() any number of times, then final() once.
class sha256 {
public:
    sha256() noexcept { reset(); }
    /// Starts a new message.
    void reset() noexcept {
        h_ = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au, 0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
        len_ = 0;
        fill_ = 0;
    }
    /// Appends n bytes.
    void update(const void* data, std::size_t n) noexcept {
        const auto* p = static_cast<const std::uint8_t*>(data);
        len_ += n;
        if (fill_ > 0) {
            const std::size_t take = n < 64 - fill_ ? n : 64 - fill_;
            std::memcpy(buf_.data() + fill_, p, take);
            fill_ += take;
            p += take;
            n -= take;
            if (fill_ < 64) return;
            block(buf_.data());
            fill_ = 0;
        }
        for (; n >= 64; n -= 64, p += 64) block(p);
        std::memcpy(buf_.data(), p, n);
        fill_ = n;
    }
    void update(std::span<const std::byte> b) noexcept { update(b.data(), b.size()); }
    void update(std::string_view s) noexcept { update(s.data(), s.size()); }
    /// Appends an unsigned integer as 8 little-endian bytes (the key encoding's word).
    void update_u64(std::uint64_t v) noexcept {
        std::uint8_t b[8];
        for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(v >> (8 * i));
        update(b, 8);
    }
    /// Pads, finishes and returns the digest; the object must be reset() before reuse.
    sha256_digest final() noexcept {
        const std::uint64_t bits = len_ * 8;
        const std::uint8_t one = 0x80;
        update(&one, 1);
        const std::uint8_t zero[64] = {};
        update(zero, fill_ <= 56 ? 56 - fill_ : 120 - fill_);
        std::uint8_t lenbe[8];
        for (int i = 0; i < 8; ++i) lenbe[i] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
        update(lenbe, 8);
        sha256_digest d;
        for (int i = 0; i < 8; ++i)
            for (int j = 0; j < 4; ++j) d[static_cast<std::size_t>(4 * i + j)] = static_cast<std::uint8_t>(h_[static_cast<std::size_t>(i)] >> (24 - 8 * j));
        return d;
    }

private:
    static constexpr std::uint32_t rotr(std::uint32_t x, int n) noexcept { return (x >> n) | (x << (32 - n)); }
    void block(const std::uint8_t* p) noexcept {
        static constexpr std::uint32_t k[64] = {
            0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
            0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
            0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
            0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
            0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
            0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
            0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
            0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};
        std::uint32_t w[64];
        for (int t = 0; t < 16; ++t)
            w[t] = std::uint32_t{p[4 * t]} << 24 | std::uint32_t{p[4 * t + 1]} << 16 | std::uint32_t{p[4 * t + 2]} << 8 |
                   std::uint32_t{p[4 * t + 3]};
        for (int t = 16; t < 64; ++t) {
            const std::uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
            const std::uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        std::uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
        for (int t = 0; t < 64; ++t) {
            const std::uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[t] + w[t];
            const std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g;
            g = f;
            f = e;
            e = d + t1;
            d = c;
            c = b;
            b = a;
            a = t1 + t2;
        }
        h_[0] += a;
        h_[1] += b;
        h_[2] += c;
        h_[3] += d;
        h_[4] += e;
        h_[5] += f;
        h_[6] += g;
        h_[7] += h;
    }

    std::array<std::uint32_t, 8> h_{};
    std::array<std::uint8_t, 64> buf_{};
    std::uint64_t len_ = 0;     // bytes so far
    std::size_t fill_ = 0;      // bytes in buf_
};

/// Lower-case hex of bytes.
inline std::string to_hex(std::span<const std::uint8_t> b) {
    static constexpr char digits[] = "0123456789abcdef";
    std::string s(b.size() * 2, '0');
    for (std::size_t i = 0; i < b.size(); ++i) {
        s[2 * i] = digits[b[i] >> 4];
        s[2 * i + 1] = digits[b[i] & 15];
    }
    return s;
}

/// SHA-256 of a byte string, as a digest.
inline sha256_digest sha256_of(std::string_view s) noexcept {
    sha256 h;
    h.update(s);
    return h.final();
}

}  // namespace tier
KVCACHE_END_NAMESPACE
