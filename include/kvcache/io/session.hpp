// kvcache io: session files, a memory's state (io/state.hpp) in a file written
// atomically (io/file.hpp). Included by io/state.hpp, whose API these functions extend.
// Thread safety: save_* only read the memory (safe beside other const calls on it); load_*
// change it (exclusive access). Two threads must not write the same path at once.
#pragma once

#include <filesystem>  // session file paths
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
/// unreadable or non-regular path gives errc::io_error. The cache is unchanged on error.
template <class Cache>
[[nodiscard]] result<load_info> load_file(Cache& cache, const std::filesystem::path& path,
                                          const load_options& opt = {}) {
    static_assert(memory<Cache>, "kvcache: io::load_file needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    auto bytes = read_file(path);
    if (!bytes) return detail::make_error(bytes.code(), "load_file: " + bytes.message());
    return load_state(cache, std::span<const std::byte>(bytes.value()), opt);
}

/// Loads a session file written by save_seq_file into sequence dst (see load_seq).
template <class Cache>
[[nodiscard]] result<load_info> load_seq_file(Cache& cache, seq_id_t dst, const std::filesystem::path& path,
                                              const load_options& opt = {}) {
    static_assert(memory<Cache>, "kvcache: io::load_seq_file needs a kvcache::memory (see kvcache/memory/memory.hpp)");
    auto bytes = read_file(path);
    if (!bytes) return detail::make_error(bytes.code(), "load_seq_file: " + bytes.message());
    return load_seq(cache, dst, std::span<const std::byte>(bytes.value()), opt);
}

}  // namespace io
KVCACHE_END_NAMESPACE
