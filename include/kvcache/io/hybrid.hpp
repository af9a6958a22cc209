// kvcache: state files of a hybrid_memory: the attention part's state (io/state.hpp, with
// the prompt) and the recurrent part's state (io/recurrent.hpp) in one envelope.
// Overloads of io::save_state / save_seq / load_state / load_seq.
//
//   offset size  field
//   0      4     magic "KVHY"
//   4      4     format version (1)
//   8      8     total_size: bytes of the whole state, checksum included
//   16     4     kind: 0 = whole memory, 1 = one sequence
//   20     4     n_layer: model layers of the hybrid memory
//   24     8     layer pattern: XXH3-64 of n_layer bytes, 1 for a recurrent layer, 0 for an
//                attention layer (must equal the memory's)
//   32     8     a: bytes of the attention part
//   40     8     r: bytes of the recurrent part
//   48     a     the attention part (a complete state of io/state.hpp, its own checksum)
//   48+a   r     the recurrent part (a complete state of io/recurrent.hpp)
//   end-8  8     XXH3-64 of every byte before it
//
// Loading validates the envelope and the recurrent part, makes the recurrent part ready
// to apply (every allocation done), then loads the attention part (which validates all
// of it before changing anything) and finally applies the recurrent part, which cannot
// fail: a refused state leaves both parts unchanged. Errors as io/state.hpp and
// io/recurrent.hpp; a memory with another layer pattern: shape_mismatch.
#pragma once

#include <cstddef>  // std::byte, std::size_t
#include <cstdint>  // fixed-width integers
#include <span>     // inputs and outputs
#include <string>   // messages
#include <vector>   // buffers

#include "../detail/policy_select.hpp"
#include "../error.hpp"
#include "../memory/hybrid.hpp"
#include "../tokens/token.hpp"
#include "detail/xxhash.hpp"
#include "format.hpp"
#include "recurrent.hpp"
#include "state.hpp"
#include "types.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

/// Magic of a hybrid state: the bytes "KVHY".
inline constexpr std::uint32_t hybrid_magic = 0x5948564Bu;
/// Hybrid state format version written and read by this library.
inline constexpr std::uint32_t hybrid_version = 1;
/// Bytes before the attention part.
inline constexpr std::size_t hybrid_header_size = 48;

namespace detail {

template <class A>
std::uint64_t hybrid_pattern(const hybrid_memory<A>& h) {
    std::vector<std::byte> b(h.n_layer());
    for (std::uint32_t l = 0; l < h.n_layer(); ++l) b[l] = std::byte{static_cast<unsigned char>(h.is_recurrent(l))};
    return checksum(std::span<const std::byte>(b));
}

template <class A>
std::vector<std::byte> write_hybrid(const hybrid_memory<A>& h, state_kind kind, std::span<const std::byte> attn,
                                    std::span<const std::byte> rec) {
    std::vector<std::byte> out(hybrid_header_size + attn.size() + rec.size() + state_checksum_size);
    byte_writer w{std::span<std::byte>(out)};
    w.put(hybrid_magic);
    w.put(hybrid_version);
    w.put(static_cast<std::uint64_t>(out.size()));
    w.put(static_cast<std::uint32_t>(kind));
    w.put(h.n_layer());
    w.put(hybrid_pattern(h));
    w.put(static_cast<std::uint64_t>(attn.size()));
    w.put(static_cast<std::uint64_t>(rec.size()));
    w.put_bytes(attn.data(), attn.size());
    w.put_bytes(rec.data(), rec.size());
    w.put(checksum(std::span<const std::byte>(out).first(out.size() - state_checksum_size)));
    return out;
}

/// The two parts of a hybrid state, after the envelope's checks.
struct hybrid_parts {
    std::span<const std::byte> attention, recurrent;
};

template <class A>
result<hybrid_parts> parse_hybrid(const char* fn, const hybrid_memory<A>& h, std::span<const std::byte> in,
                                  state_kind want) {
    using std::to_string;
    auto fail = [fn](errc c, const std::string& msg) { return kvcache::detail::make_error(c, std::string(fn) + ": " + msg); };
    constexpr std::size_t min_size = hybrid_header_size + state_checksum_size;
    if (in.size() >= 4 && load_le<std::uint32_t>(in.data()) != hybrid_magic)
        return fail(errc::bad_magic, "the bytes do not start with \"KVHY\" (a hybrid memory's state)");
    if (in.size() < 8)
        return fail(errc::truncated, to_string(in.size()) + " bytes, a hybrid state has at least " + to_string(min_size));
    if (const auto v = load_le<std::uint32_t>(in.data() + 4); v != hybrid_version)
        return fail(errc::unsupported_version,
                    "version " + to_string(v) + ", this library reads version " + to_string(hybrid_version));
    if (in.size() < min_size)
        return fail(errc::truncated, to_string(in.size()) + " bytes, a hybrid state has at least " + to_string(min_size));
    byte_reader r{in};
    r.take(8);
    const auto total = r.get<std::uint64_t>();
    if (total > in.size())
        return fail(errc::truncated, "total_size = " + to_string(total) + " but only " + to_string(in.size()) + " bytes");
    if (total < in.size())
        return fail(errc::trailing_bytes, to_string(in.size() - total) + " bytes after the state's end (total_size = " +
                                              to_string(total) + ")");
    if (checksum(in.first(in.size() - state_checksum_size)) !=
        load_le<std::uint64_t>(in.data() + in.size() - state_checksum_size))
        return fail(errc::checksum_mismatch, "the checksum does not match the contents");
    const auto kind = r.get<std::uint32_t>();
    if (kind > 1) return fail(errc::unsupported, "state kind " + to_string(kind) + " unknown (0 or 1)");
    if (kind != static_cast<std::uint32_t>(want))
        return fail(errc::unsupported, kind == 0 ? "the bytes hold a whole memory; use load_state"
                                                 : "the bytes hold one sequence; use load_seq");
    if (const auto n = r.get<std::uint32_t>(); n != h.n_layer())
        return fail(errc::shape_mismatch,
                    "n_layer = " + to_string(n) + " in the state, the memory has " + to_string(h.n_layer()));
    if (r.get<std::uint64_t>() != hybrid_pattern(h))
        return fail(errc::shape_mismatch, "the state's layer pattern (which layers are recurrent) differs from the memory's");
    const auto a = r.get<std::uint64_t>(), b = r.get<std::uint64_t>();
    const auto parts = add_u64(a, b);
    if (!parts || *parts != total - min_size)
        return fail(errc::invalid_cell, "part sizes " + to_string(a) + " + " + to_string(b) +
                                            " do not add up to total_size = " + to_string(total));
    hybrid_parts p;
    p.attention = in.subspan(hybrid_header_size, static_cast<std::size_t>(a));
    p.recurrent = in.subspan(hybrid_header_size + static_cast<std::size_t>(a), static_cast<std::size_t>(b));
    return p;
}

template <class A>
result<load_info> load_hybrid(const char* fn, hybrid_memory<A>& h, std::span<const std::byte> in, state_kind kind,
                              seq_id_t dst, const load_options& opt) {
    const kvcache::detail::internal_access acc{};
    if (h.in_transaction())
        kvcache::detail::fail(errc::transaction_open,
                              std::string(fn) + ": placements are staged; commit() or restore() first");
    auto parts = parse_hybrid(fn, h, in, kind);
    if (!parts) return kvcache::detail::make_error(parts.code(), parts.message());
    auto st = parse_recurrent(fn, h.recurrent(), parts.value().recurrent, kind, opt);
    if (!st) return kvcache::detail::make_error(st.code(), st.message());
    recurrent_prepared rp = recurrent_prepare(h.recurrent(), std::move(st.value()), dst);
    A& attn = h.attention_for_update(acc);
    result<load_info> r = dst < 0 ? io::load_state(attn, parts.value().attention, opt)
                                  : io::load_seq(attn, dst, parts.value().attention, opt);
    if (!r) return r;  // the attention part refused: nothing changed in either
    recurrent_apply(h.recurrent_for_update(acc), rp);
    return r;
}

}  // namespace detail

/// Serialises both parts of a hybrid memory (the prompt goes with the attention part).
template <class A>
[[nodiscard]] std::vector<std::byte> save_state(const hybrid_memory<A>& mem, std::span<const token_t> tokens = {},
                                                std::span<const media_chunk> media = {}) {
    return detail::write_hybrid(mem, state_kind::whole_cache, io::save_state(mem.attention(), tokens, media),
                                io::save_state(mem.recurrent()));
}
/// Serialises sequence seq of both parts. Throws invalid_argument for seq outside [0, n_seq_max).
template <class A>
[[nodiscard]] std::vector<std::byte> save_seq(const hybrid_memory<A>& mem, seq_id_t seq,
                                              std::span<const token_t> tokens = {},
                                              std::span<const media_chunk> media = {}) {
    return detail::write_hybrid(mem, state_kind::one_sequence, io::save_seq(mem.attention(), seq, tokens, media),
                                io::save_seq(mem.recurrent(), seq));
}
/// Replaces both parts by a state of save_state (see the file comment); on error neither
/// part changed. Throws transaction_open when placements are staged.
template <class A>
[[nodiscard]] result<load_info> load_state(hybrid_memory<A>& mem, std::span<const std::byte> bytes,
                                           const load_options& opt = {}) {
    return detail::load_hybrid("load_state", mem, bytes, state_kind::whole_cache, -1, opt);
}
/// Loads a state of save_seq into sequence dst of both parts, or of neither.
template <class A>
[[nodiscard]] result<load_info> load_seq(hybrid_memory<A>& mem, seq_id_t dst, std::span<const std::byte> bytes,
                                         const load_options& opt = {}) {
    if (dst < 0 || static_cast<std::uint32_t>(dst) >= mem.n_seq_max())
        kvcache::detail::fail(errc::invalid_argument, "load_seq: dst = " + std::to_string(dst) + ", must be in [0, " +
                                                          std::to_string(mem.n_seq_max()) + ")");
    return detail::load_hybrid("load_seq", mem, bytes, state_kind::one_sequence, dst, opt);
}

}  // namespace io
KVCACHE_END_NAMESPACE
