// kvcache io: session files, a memory's state (io/state.hpp) in a file written
// atomically (io/file.hpp). Included by io/state.hpp, whose API these functions extend.
// Thread safety: save_* only read the memory (safe beside other const calls on it); load_*
// change it (exclusive access). Two threads must not write the same path at once.
#pragma once

#include <algorithm>   // std::min
#include <cstdint>     // sizes
#include <filesystem>  // session file paths
#include <optional>    // a part's problem
#include <string>      // messages
#include <span>        // prompts
#include <vector>      // file contents

#include "../error.hpp"
#include "../memory/memory.hpp"
#include "../tokens/token.hpp"
#include "file.hpp"
#include "state.hpp"
#include "types.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

// ----------------------------------------------------------------------- files

namespace detail {

/// Reads the state file at `path` for `mem`, deciding from its first bytes whether it can
/// be a state this memory loads (check_state_head; for a composite, its header, part table
/// and every part's head) before reading it whole: a file too large for what its header
/// declares, or with a header the memory refuses, is never read past its header.
template <class Memory>
result<std::vector<std::byte>> read_state_file(const char* fn, const Memory& mem, const std::filesystem::path& path,
                                               state_kind kind, seq_id_t dst, const load_options& opt) {
    const std::string who = std::string(fn) + ": ";
    auto f = input_file::open(path);
    if (!f) return make_error(f.code(), who + f.message());
    input_file& file = f.value();
    const std::uint64_t size = file.size();
    auto read = [&](std::uint64_t offset, std::uint64_t n) { return file.read(offset, std::min(n, size - offset)); };
    if constexpr (composite_memory<Memory>) {
        const composite_expect e = expect_of(mem, kind);
        auto head = read(0, composite_head_size(e));
        if (!head) return make_error(head.code(), who + head.message());
        auto extents = parse_composite_head(fn, head.value(), size, e);
        if (!extents) return make_error(extents.code(), extents.message());
        std::optional<error_info> bad;
        std::size_t i = 0;
        mem.for_each_part([&](const auto& part) {
            const part_extent x = extents.value()[i];
            const std::string where = who + "part " + std::to_string(i++) + ": ";
            if (bad) return;
            auto ph = file.read(x.offset, std::min<std::uint64_t>(x.size, state_header_size));
            if (!ph)
                bad = make_error(ph.code(), where + ph.message());
            else if (auto pb = check_state_head(part, ph.value(), x.size, kind, dst, opt))
                bad = make_error(pb->code, where + pb->msg);
        });
        if (bad) return std::move(*bad);
    } else {
        auto head = read(0, state_header_size);
        if (!head) return make_error(head.code(), who + head.message());
        if (auto pb = check_state_head(mem, head.value(), size, kind, dst, opt))
            return make_error(pb->code, who + pb->msg);
    }
    auto all = file.read(0, size);
    if (!all) return make_error(all.code(), who + all.message());
    return all;
}

}  // namespace detail

/// Saves the whole cache to a session file (temporary file + rename: never a
/// truncated file under `path`). errc::io_error names the path and the reason.
template <class Cache>
[[nodiscard]] result<void> save_file(const Cache& cache, const std::filesystem::path& path,
                                     std::span<const token_t> tokens = {}, std::span<const media_chunk> media = {}) {
    static_assert(memory<Cache>, "kvcache: io::save_file needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    return write_file_atomic(path, save_state(cache, tokens, media));
}

/// Saves one sequence to a session file (see save_file).
template <class Cache>
[[nodiscard]] result<void> save_seq_file(const Cache& cache, seq_id_t seq, const std::filesystem::path& path,
                                         std::span<const token_t> tokens = {}, std::span<const media_chunk> media = {}) {
    static_assert(memory<Cache>, "kvcache: io::save_seq_file needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    return write_file_atomic(path, save_seq(cache, seq, tokens, media));
}

/// Loads a session file written by save_file (see load_state); a missing,
/// unreadable or non-regular path gives errc::io_error. The file's header is checked
/// against the cache before the file is read whole (a file larger than the state its
/// header describes, or one the cache would refuse, costs one header read; the token
/// count is bounded by opt.max_tokens). The cache is unchanged on error.
template <class Cache>
[[nodiscard]] result<load_info> load_file(Cache& cache, const std::filesystem::path& path,
                                          const load_options& opt = {}) {
    static_assert(memory<Cache>, "kvcache: io::load_file needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if (cache.in_transaction())
        kvcache::detail::fail(errc::transaction_open, "load_file: placements are staged; commit() or restore() first");
    auto bytes = detail::read_state_file("load_file", cache, path, state_kind::whole_cache, -1, opt);
    if (!bytes) return detail::make_error(bytes.code(), bytes.message());
    return load_state(cache, std::span<const std::byte>(bytes.value()), opt);
}

/// Loads a session file written by save_seq_file into sequence dst (see load_seq; the
/// header is checked before the file is read whole, as for load_file).
template <class Cache>
[[nodiscard]] result<load_info> load_seq_file(Cache& cache, seq_id_t dst, const std::filesystem::path& path,
                                              const load_options& opt = {}) {
    static_assert(memory<Cache>, "kvcache: io::load_seq_file needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    if (cache.in_transaction())
        kvcache::detail::fail(errc::transaction_open, "load_seq_file: placements are staged; commit() or restore() first");
    if (dst < 0 || static_cast<std::uint32_t>(dst) >= cache.n_seq_max())
        kvcache::detail::fail(errc::invalid_argument, "load_seq_file: dst = " + std::to_string(dst) +
                                                          ", must be in [0, " + std::to_string(cache.n_seq_max()) + ")");
    auto bytes = detail::read_state_file("load_seq_file", cache, path, state_kind::one_sequence, dst, opt);
    if (!bytes) return detail::make_error(bytes.code(), bytes.message());
    return load_seq(cache, dst, std::span<const std::byte>(bytes.value()), opt);
}

}  // namespace io
KVCACHE_END_NAMESPACE
