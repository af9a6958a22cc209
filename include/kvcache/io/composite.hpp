// kvcache io: the state of a composite memory (kvcache::composite_memory, e.g.
// iswa_cache): a small header naming the composite kind and its parts, then each part's
// ordinary state (format.hpp) in for_each_part order, then a checksum of everything.
//
//   offset size  field
//   0      4     magic "KVSC"
//   4      4     composite format version (1)
//   8      8     total_size: bytes of the whole composite state, checksum included
//   16     4     kind: 0 = whole memory, 1 = one sequence (as in format.hpp)
//   20     4     composite kind: 1 = iswa_cache
//   24     4     n_parts (2 for iswa_cache: the full cache, then the sliding-window ring)
//   28     4     window: the composite's window (iswa_cache::window)
//   32     16*n  per part: u32 window of the part's layout (0 = none), u32 n_layer,
//                u64 size of the part's state in bytes
//   ...          the parts' states, back to back (each a complete "KVST" state with its
//                own fingerprint and checksum); the prompt (tokens, media) is stored in
//                part 0 only
//   end-8  8     XXH3-64 of every byte before it
//
// Why a wrapper around the existing states rather than one merged state: every part is
// validated by the same parser as a single cache (fingerprint, cells, pruning table), the
// part layout is recorded exactly (a ring state cannot be loaded into the full cache of a
// composite even where single-cache loading would accept it across layouts), and the
// composite window is checked exactly (an ISWA cache with another window refuses it).
#pragma once

#include <cstddef>   // std::byte, std::size_t
#include <cstdint>   // fixed-width integers
#include <optional>  // problems
#include <span>      // byte views
#include <string>    // messages
#include <utility>   // std::pair
#include <vector>    // part sizes

#include "../error.hpp"
#include "detail/xxhash.hpp"
#include "fingerprint.hpp"
#include "format.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

/// Magic of a composite state: the bytes "KVSC".
inline constexpr std::uint32_t composite_magic = 0x4353564Bu;
/// Composite format version written and read by this library.
inline constexpr std::uint32_t composite_version = 1;
/// Composite kind of iswa_cache.
inline constexpr std::uint32_t composite_kind_iswa = 1;
/// Bytes of the composite header before the part table.
inline constexpr std::size_t composite_header_size = 32;
/// Bytes of one part table entry.
inline constexpr std::size_t composite_part_entry_size = 16;

namespace detail {

/// What the composite header says of one part, and what the memory expects.
struct composite_part {
    std::uint32_t window = 0;
    std::uint32_t n_layer = 0;
    std::uint64_t size = 0;
};

/// What the memory expects of a composite state.
struct composite_expect {
    state_kind kind;
    std::uint32_t composite_kind;
    std::uint32_t window;
    std::vector<composite_part> parts;  // size unused
};

/// Bytes of the composite header and part table for the parts `e` expects.
inline std::size_t composite_head_size(const composite_expect& e) {
    return composite_header_size + e.parts.size() * composite_part_entry_size;
}

/// Bytes of a composite state holding parts of the given sizes.
inline std::size_t composite_bytes(std::span<const std::size_t> part_sizes) {
    std::size_t n = composite_header_size + part_sizes.size() * composite_part_entry_size + state_checksum_size;
    for (std::size_t s : part_sizes) n += s;
    return n;
}

/// Writes the composite header and part table; returns where part 0's bytes go.
inline std::size_t write_composite_header(std::span<std::byte> out, const composite_expect& e,
                                          std::span<const std::size_t> part_sizes) {
    byte_writer w(out);
    w.put<std::uint32_t>(composite_magic);
    w.put<std::uint32_t>(composite_version);
    w.put<std::uint64_t>(out.size());
    w.put<std::uint32_t>(static_cast<std::uint32_t>(e.kind));
    w.put<std::uint32_t>(e.composite_kind);
    w.put<std::uint32_t>(static_cast<std::uint32_t>(e.parts.size()));
    w.put<std::uint32_t>(e.window);
    for (std::size_t i = 0; i < e.parts.size(); ++i) {
        w.put<std::uint32_t>(e.parts[i].window);
        w.put<std::uint32_t>(e.parts[i].n_layer);
        w.put<std::uint64_t>(part_sizes[i]);
    }
    return static_cast<std::size_t>(w.pos() - out.data());
}

/// Writes the trailing checksum over out[0, size - 8).
inline void write_composite_checksum(std::span<std::byte> out) {
    store_le<std::uint64_t>(out.data() + out.size() - state_checksum_size,
                            checksum(out.first(out.size() - state_checksum_size)));
}

/// Where one part's state lies in a composite state.
struct part_extent {
    std::uint64_t offset = 0;
    std::uint64_t size = 0;
};

/// Validates a composite state's header and part table against what the memory expects,
/// from its first bytes (`head`: at least the header and part table, when `size` allows)
/// and the `size` bytes present; returns where each part lies, or the problem.
inline result<std::vector<part_extent>> parse_composite_head(const char* fn, std::span<const std::byte> head,
                                                             std::uint64_t size, const composite_expect& e) {
    const std::string who = std::string(fn) + ": ";
    using parts_t = std::vector<part_extent>;
    auto err = [&](errc code, const std::string& msg) -> result<parts_t> { return make_error(code, who + msg); };
    if (size >= 4 && load_le<std::uint32_t>(head.data()) != composite_magic) {
        const auto m = load_le<std::uint32_t>(head.data());
        return err(errc::bad_magic, "magic is " + hex(m) + ", expected " + hex(composite_magic) +
                                        " (\"KVSC\"): not a composite memory state" +
                                        (m == state_magic ? " (a single-cache state: load it into a kv_cache)" : ""));
    }
    if (size >= 8 && load_le<std::uint32_t>(head.data() + 4) != composite_version)
        return err(errc::unsupported_version, "composite format version " +
                                                  std::to_string(load_le<std::uint32_t>(head.data() + 4)) +
                                                  ", this library reads version " + std::to_string(composite_version));
    const std::size_t table = composite_head_size(e);
    if (size < table + state_checksum_size)
        return err(errc::truncated, "state is " + std::to_string(size) + " bytes, shorter than the " +
                                        std::to_string(table + state_checksum_size) +
                                        "-byte composite header, part table and checksum");
    const auto total = load_le<std::uint64_t>(head.data() + 8);
    if (total < table + state_checksum_size || size < total)
        return err(errc::truncated, "state declares " + std::to_string(total) + " bytes, got " + std::to_string(size));
    if (size > total)
        return err(errc::trailing_bytes, "state declares " + std::to_string(total) + " bytes, got " +
                                             std::to_string(size));
    const auto kind = load_le<std::uint32_t>(head.data() + 16);
    if (kind > 1) return err(errc::unsupported, "state kind " + std::to_string(kind) + " unknown (0 or 1)");
    if (kind != static_cast<std::uint32_t>(e.kind))
        return err(errc::unsupported, kind == 0 ? "the bytes hold a whole memory; use load_state"
                                                : "the bytes hold one sequence; use load_seq");
    const auto ck = load_le<std::uint32_t>(head.data() + 20);
    if (ck != e.composite_kind)
        return err(errc::shape_mismatch, "composite kind = " + std::to_string(ck) + " in the state, the memory is " +
                                             std::to_string(e.composite_kind));
    const auto n_parts = load_le<std::uint32_t>(head.data() + 24);
    if (n_parts != e.parts.size())
        return err(errc::shape_mismatch, "n_parts = " + std::to_string(n_parts) + " in the state, the memory has " +
                                             std::to_string(e.parts.size()));
    const auto window = load_le<std::uint32_t>(head.data() + 28);
    if (window != e.window)
        return err(errc::shape_mismatch, "window = " + std::to_string(window) + " in the state, the memory has " +
                                             std::to_string(e.window));
    parts_t parts;
    std::uint64_t at = table;
    const std::uint64_t end = size - state_checksum_size;
    for (std::size_t i = 0; i < e.parts.size(); ++i) {
        const std::byte* p = head.data() + composite_header_size + i * composite_part_entry_size;
        const std::string part = "part " + std::to_string(i) + ": ";
        const auto w = load_le<std::uint32_t>(p);
        const auto nl = load_le<std::uint32_t>(p + 4);
        const auto sz = load_le<std::uint64_t>(p + 8);
        if (w != e.parts[i].window)
            return err(errc::shape_mismatch, part + "window = " + std::to_string(w) + " in the state, the memory's part has " +
                                                  std::to_string(e.parts[i].window));
        if (nl != e.parts[i].n_layer)
            return err(errc::shape_mismatch, part + "n_layer = " + std::to_string(nl) +
                                                  " in the state, the memory's part has " +
                                                  std::to_string(e.parts[i].n_layer));
        if (sz > end - at)
            return err(errc::truncated, part + "declares " + std::to_string(sz) + " bytes, " +
                                            std::to_string(end - at) + " left");
        parts.push_back(part_extent{at, sz});
        at += sz;
    }
    if (at != end)
        return err(errc::trailing_bytes, std::to_string(end - at) + " bytes between the last part and the checksum");
    return parts;
}

/// Validates a whole composite state (parse_composite_head, then the checksum); returns
/// each part's bytes, or the problem.
inline result<std::vector<std::span<const std::byte>>> parse_composite(const char* fn, std::span<const std::byte> in,
                                                                        const composite_expect& e) {
    using parts_t = std::vector<std::span<const std::byte>>;
    auto extents = parse_composite_head(fn, in, in.size(), e);
    if (!extents) return make_error(extents.code(), extents.message());
    const std::uint64_t size = in.size();
    const std::uint64_t stored = load_le<std::uint64_t>(in.data() + size - state_checksum_size);
    const std::uint64_t actual = checksum(in.first(static_cast<std::size_t>(size - state_checksum_size)));
    if (stored != actual)
        return make_error(errc::checksum_mismatch,
                          std::string(fn) + ": stored checksum " + hex(stored) + ", computed " + hex(actual));
    parts_t parts;
    for (const part_extent& x : extents.value())
        parts.push_back(in.subspan(static_cast<std::size_t>(x.offset), static_cast<std::size_t>(x.size)));
    return parts;
}

}  // namespace detail
}  // namespace io
KVCACHE_END_NAMESPACE
