// kvcache tier: the bytes a storage tier holds for one entry, and their verification.
//
// Blob format, version 1 (integers little-endian):
//   offset size  field
//   0      4     magic "KVTB"
//   4      4     version (1)
//   8      8     total_size: bytes of the whole blob, checksum included
//   16     32    key digest (tier/key.hpp)
//   48     32    memory fingerprint digest (tier::memory_fingerprint)
//   80     8     tenant salt
//   88     4     key_tokens: positions the key covers (a block boundary)
//   92     4     n_tokens: positions of the entry (>= key_tokens)
//   96     4     n_media: media chunks
//   100    4     reserved, 0
//   104    8     payload_size
//   112          tokens (n_tokens x i32), media (n_media x {u64 id, u32 begin, u32 n_pos}),
//                payload (io::save_seq bytes: the K/V state with its own checksum)
//   end-8  8     XXH3-64 of every byte before it (io::checksum)
// A blob is used only after verify_blob() accepted it: sizes, checksum, key, fingerprint,
// salt and the tokens the key covers all equal to what the request expects. Anything else
// is a refusal with a reason; then io::load_seq validates the payload once more.
#pragma once

#include <cstddef>   // std::byte, std::size_t
#include <cstdint>   // fixed-width integers
#include <cstring>   // std::memcmp
#include <span>      // bytes
#include <vector>    // blob bytes

#include "../io/detail/xxhash.hpp"
#include "../io/format.hpp"
#include "../tokens/prompt_tokens.hpp"
#include "key.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

/// Magic at offset 0: the bytes "KVTB".
inline constexpr std::uint32_t blob_magic = 0x4254564Bu;
/// Blob format version written and read by this library.
inline constexpr std::uint32_t blob_version = 1;
/// Bytes before the token list.
inline constexpr std::size_t blob_header_size = 112;
/// Bytes of the trailing checksum.
inline constexpr std::size_t blob_checksum_size = 8;

/// Why a stored blob was not used (each counted; none = used).
enum class refusal : std::uint8_t {
    none = 0,
    corrupt,      ///< bad magic, version, sizes or checksum (torn write, bit rot, truncation)
    key,          ///< the blob names another key (a collision or a misplaced blob)
    fingerprint,  ///< saved by another model or memory configuration
    tenant,       ///< saved for another tenant salt
    tokens,       ///< the tokens the key covers differ from the request's (a hash collision)
    load,         ///< io::load_seq refused the payload, or the memory had no room
};
/// Number of refusal values (none included).
inline constexpr std::size_t n_refusals = 7;
/// Stable name of a refusal (Prometheus label value).
constexpr const char* to_string(refusal r) noexcept {
    switch (r) {
        case refusal::none: return "none";
        case refusal::corrupt: return "corrupt";
        case refusal::key: return "key";
        case refusal::fingerprint: return "fingerprint";
        case refusal::tenant: return "tenant";
        case refusal::tokens: return "tokens";
        case refusal::load: return "load";
    }
    return "?";
}

/// What a blob's fixed header says (read by read_blob_header; nothing verified but the
/// magic, version and sizes).
struct blob_header {
    std::uint64_t total_size = 0;
    key k;
    sha256_digest fingerprint{};
    std::uint64_t salt = 0;
    std::uint32_t key_tokens = 0;
    std::uint32_t n_tokens = 0;
    std::uint32_t n_media = 0;
    std::uint64_t payload_size = 0;
};

namespace detail {
using io::detail::load_le;
using io::detail::store_le;
inline constexpr std::size_t blob_media_size = 16;
}  // namespace detail

/// Builds the blob of an entry: `tokens` (n_tokens positions, whose first key_tokens
/// positions the key names) and the io::save_seq bytes of its sequence. Throws
/// invalid_argument if key_tokens > tokens.size().
[[nodiscard]] inline std::vector<std::byte> make_blob(const key& k, const sha256_digest& fingerprint,
                                                      std::uint64_t salt, std::uint32_t key_tokens,
                                                      const prompt_tokens& tokens, std::span<const std::byte> payload) {
    if (key_tokens > tokens.size())
        kvcache::detail::fail(errc::invalid_argument, "tier::make_blob: key_tokens = " + std::to_string(key_tokens) +
                                                          " > tokens.size() = " + std::to_string(tokens.size()));
    const std::size_t n = tokens.size(), nm = tokens.media().size();
    const std::size_t total = blob_header_size + n * 4 + nm * detail::blob_media_size + payload.size() + blob_checksum_size;
    std::vector<std::byte> out(total);
    std::byte* p = out.data();
    detail::store_le<std::uint32_t>(p + 0, blob_magic);
    detail::store_le<std::uint32_t>(p + 4, blob_version);
    detail::store_le<std::uint64_t>(p + 8, total);
    std::memcpy(p + 16, k.digest.data(), 32);
    std::memcpy(p + 48, fingerprint.data(), 32);
    detail::store_le<std::uint64_t>(p + 80, salt);
    detail::store_le<std::uint32_t>(p + 88, key_tokens);
    detail::store_le<std::uint32_t>(p + 92, static_cast<std::uint32_t>(n));
    detail::store_le<std::uint32_t>(p + 96, static_cast<std::uint32_t>(nm));
    detail::store_le<std::uint32_t>(p + 100, 0);
    detail::store_le<std::uint64_t>(p + 104, payload.size());
    std::byte* q = p + blob_header_size;
    for (token_t t : tokens.tokens()) {
        detail::store_le<std::int32_t>(q, t);
        q += 4;
    }
    for (const media_chunk& c : tokens.media()) {
        detail::store_le<std::uint64_t>(q, c.id);
        detail::store_le<std::uint32_t>(q + 8, c.begin);
        detail::store_le<std::uint32_t>(q + 12, c.n_pos);
        q += detail::blob_media_size;
    }
    if (!payload.empty()) std::memcpy(q, payload.data(), payload.size());
    detail::store_le<std::uint64_t>(p + total - blob_checksum_size,
                                    io::checksum(std::span<const std::byte>(out).first(total - blob_checksum_size)));
    return out;
}

/// Reads the fixed header of `bytes` (at least blob_header_size of them): refusal::corrupt
/// unless magic, version and the sizes agree with each other and with total_size
/// (bytes.size() itself may be only the header: a storage tier's index check).
[[nodiscard]] inline refusal read_blob_header(std::span<const std::byte> bytes, blob_header& h) noexcept {
    if (bytes.size() < blob_header_size) return refusal::corrupt;
    const std::byte* p = bytes.data();
    if (detail::load_le<std::uint32_t>(p) != blob_magic || detail::load_le<std::uint32_t>(p + 4) != blob_version)
        return refusal::corrupt;
    h.total_size = detail::load_le<std::uint64_t>(p + 8);
    std::memcpy(h.k.digest.data(), p + 16, 32);
    std::memcpy(h.fingerprint.data(), p + 48, 32);
    h.salt = detail::load_le<std::uint64_t>(p + 80);
    h.key_tokens = detail::load_le<std::uint32_t>(p + 88);
    h.n_tokens = detail::load_le<std::uint32_t>(p + 92);
    h.n_media = detail::load_le<std::uint32_t>(p + 96);
    h.payload_size = detail::load_le<std::uint64_t>(p + 104);
    if (detail::load_le<std::uint32_t>(p + 100) != 0 || h.key_tokens > h.n_tokens) return refusal::corrupt;
    // Every term is below 2^36, so the sum cannot overflow.
    if (h.payload_size > (std::uint64_t{1} << 48)) return refusal::corrupt;
    const std::uint64_t need = blob_header_size + std::uint64_t{h.n_tokens} * 4 +
                               std::uint64_t{h.n_media} * detail::blob_media_size + h.payload_size + blob_checksum_size;
    if (need != h.total_size) return refusal::corrupt;
    return refusal::none;
}

/// A verified blob: its tokens and the K/V payload (a view into the blob's bytes).
struct blob_view {
    blob_header header;
    prompt_tokens tokens;
    std::span<const std::byte> payload;
};

/// Verifies a blob fetched for key `k` of `request` (whose first k_tokens positions the
/// key names): sizes and checksum (corrupt), key, fingerprint, tenant salt, then the
/// covered tokens and media against the request's (tokens). Fills `out` only when it
/// returns refusal::none.
[[nodiscard]] inline refusal verify_blob(std::span<const std::byte> bytes, const key& k, std::uint32_t k_tokens,
                                         const sha256_digest& fingerprint, std::uint64_t salt,
                                         const prompt_tokens& request, blob_view& out) {
    blob_header h;
    if (read_blob_header(bytes, h) != refusal::none || h.total_size != bytes.size()) return refusal::corrupt;
    const std::size_t body = bytes.size() - blob_checksum_size;
    if (io::checksum(bytes.first(body)) != detail::load_le<std::uint64_t>(bytes.data() + body)) return refusal::corrupt;
    if (h.k != k || h.key_tokens != k_tokens) return refusal::key;
    if (h.fingerprint != fingerprint) return refusal::fingerprint;
    if (h.salt != salt) return refusal::tenant;
    if (k_tokens > request.size()) return refusal::tokens;
    const std::byte* q = bytes.data() + blob_header_size;
    std::vector<token_t> toks(h.n_tokens);
    for (std::uint32_t i = 0; i < h.n_tokens; ++i) toks[i] = detail::load_le<std::int32_t>(q + 4 * std::size_t{i});
    q += 4 * std::size_t{h.n_tokens};
    std::vector<media_chunk> media(h.n_media);
    for (std::uint32_t i = 0; i < h.n_media; ++i, q += detail::blob_media_size)
        media[i] = media_chunk{detail::load_le<std::uint64_t>(q), detail::load_le<std::uint32_t>(q + 8),
                               detail::load_le<std::uint32_t>(q + 12)};
    if (io::detail::check_tokens(toks, media)) return refusal::corrupt;  // checksummed, yet malformed: a forged blob
    prompt_tokens t = prompt_tokens::from(toks, media);
    if (t.common_prefix(request) < k_tokens) return refusal::tokens;
    out.header = h;
    out.tokens = std::move(t);
    out.payload = std::span<const std::byte>(q, static_cast<std::size_t>(h.payload_size));
    return refusal::none;
}

}  // namespace tier
KVCACHE_END_NAMESPACE
