// kvcache: whole-file reads and crash-safe whole-file writes for session files.
//
// write_file_atomic writes to a temporary name in the same directory, flushes it
// to disk and renames it over the target, so a crash mid-save leaves either the
// old file or the new one under the real name, never a truncated one.
#pragma once

#include <atomic>        // unique temporary names
#include <cerrno>        // errno
#include <chrono>        // unique temporary names
#include <cstddef>       // std::byte
#include <cstdint>       // std::uint64_t
#include <cstdio>        // std::FILE
#include <cstring>       // std::strerror
#include <filesystem>    // paths, rename, status
#include <limits>        // seek offsets
#include <new>           // std::bad_alloc
#include <span>          // byte views
#include <string>        // messages
#include <system_error>  // std::error_code
#include <utility>       // std::swap
#include <vector>        // file contents

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>  // fsync, fileno
#endif

#include "../error.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace io {

namespace detail {
inline std::string errno_text(int e) { return std::strerror(e); }

/// Closes a FILE on scope exit.
struct file_closer {
    std::FILE* f = nullptr;
    ~file_closer() {
        if (f != nullptr) std::fclose(f);
    }
};
}  // namespace detail

/// Writes `bytes` to `path` through a temporary file in the same directory and a
/// rename. Errors (errc::io_error) name the path and the system's reason; the
/// temporary file is removed and an existing file under `path` is left as it was.
[[nodiscard]] inline result<void> write_file_atomic(const std::filesystem::path& path, std::span<const std::byte> bytes) {
    namespace fs = std::filesystem;
    static std::atomic<std::uint64_t> counter{0};
    const auto stamp = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    fs::path tmp = path;
    tmp += ".tmp-" + std::to_string(stamp) + "-" + std::to_string(counter.fetch_add(1));
    auto fail = [&](const std::string& what, int e) -> result<void> {
        std::error_code ignore;
        fs::remove(tmp, ignore);
        return kvcache::detail::make_error(errc::io_error, "write_file_atomic: " + what + " '" + tmp.string() +
                                                               "': " + detail::errno_text(e));
    };
    {
        detail::file_closer fc{std::fopen(tmp.c_str(), "wb")};
        if (fc.f == nullptr) return kvcache::detail::make_error(
                                 errc::io_error, "write_file_atomic: cannot create '" + tmp.string() +
                                                     "': " + detail::errno_text(errno));
        if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), fc.f) != bytes.size())
            return fail("cannot write", errno);
        if (std::fflush(fc.f) != 0) return fail("cannot flush", errno);
#if defined(__unix__) || defined(__APPLE__)
        if (::fsync(::fileno(fc.f)) != 0) return fail("cannot sync", errno);
#endif
        const int rc = std::fclose(fc.f);
        fc.f = nullptr;
        if (rc != 0) return fail("cannot close", errno);
    }
    std::error_code ec;
    fs::rename(tmp, path, ec);
    if (ec) {
        std::error_code ignore;
        fs::remove(tmp, ignore);
        return kvcache::detail::make_error(errc::io_error, "write_file_atomic: cannot rename '" + tmp.string() +
                                                               "' to '" + path.string() + "': " + ec.message());
    }
    return {};
}

/// A regular file opened for reading, with its size: lets a loader look at a file's
/// header (read) before it decides to read the whole file.
class input_file {
public:
    /// Opens `path`. A missing, unreadable or non-regular path (a directory, a device)
    /// gives errc::io_error naming the path and the reason.
    [[nodiscard]] static result<input_file> open(const std::filesystem::path& path) {
        namespace fs = std::filesystem;
        std::error_code ec;
        const fs::file_status st = fs::status(path, ec);
        if (ec) return fail(path, ec.message());
        if (fs::is_directory(st)) return fail(path, "is a directory");
        if (!fs::is_regular_file(st)) return fail(path, "not a regular file");
        input_file f;
        f.path_ = path;
        f.fc_.f = std::fopen(path.c_str(), "rb");
        if (f.fc_.f == nullptr) return fail(path, "cannot open: " + detail::errno_text(errno));
        if (std::fseek(f.fc_.f, 0, SEEK_END) != 0) return fail(path, "cannot seek: " + detail::errno_text(errno));
        const long end = std::ftell(f.fc_.f);
        if (end < 0) return fail(path, "cannot tell size: " + detail::errno_text(errno));
        f.size_ = static_cast<std::uint64_t>(end);
        return f;
    }
    input_file(input_file&& o) noexcept : path_(std::move(o.path_)), size_(o.size_) { std::swap(fc_.f, o.fc_.f); }
    input_file& operator=(input_file&&) = delete;

    /// Bytes in the file when it was opened.
    [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
    [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

    /// The n bytes at `offset` (errc::io_error if they are not all there or cannot be read
    /// or allocated).
    [[nodiscard]] result<std::vector<std::byte>> read(std::uint64_t offset, std::uint64_t n) {
        if (offset > size_ || n > size_ - offset)
            return fail(path_, "bytes [" + std::to_string(offset) + ", " + std::to_string(offset + n) +
                                   ") are past its end (" + std::to_string(size_) + " bytes)");
        if (offset > static_cast<std::uint64_t>(std::numeric_limits<long>::max()) ||
            std::fseek(fc_.f, static_cast<long>(offset), SEEK_SET) != 0)
            return fail(path_, "cannot seek: " + detail::errno_text(errno));
        std::vector<std::byte> out;
        try {
            out.resize(static_cast<std::size_t>(n));
        } catch (const std::bad_alloc&) {
            return fail(path_, "cannot allocate " + std::to_string(n) + " bytes");
        }
        if (!out.empty() && std::fread(out.data(), 1, out.size(), fc_.f) != out.size())
            return fail(path_, "short read: " + detail::errno_text(errno));
        return out;
    }

private:
    input_file() = default;
    static error_info fail(const std::filesystem::path& p, const std::string& why) {
        return kvcache::detail::make_error(errc::io_error, "read_file: '" + p.string() + "': " + why);
    }
    std::filesystem::path path_;
    detail::file_closer fc_;
    std::uint64_t size_ = 0;
};

/// Reads a whole regular file. Errors as for input_file::open; a file larger than
/// max_bytes gives errc::no_space (and is not read).
[[nodiscard]] inline result<std::vector<std::byte>> read_file(const std::filesystem::path& path,
                                                              std::uint64_t max_bytes = ~std::uint64_t{0}) {
    auto f = input_file::open(path);
    if (!f) return kvcache::detail::make_error(f.code(), f.message());
    const std::uint64_t n = f.value().size();
    if (n > max_bytes)
        return kvcache::detail::make_error(errc::no_space, "read_file: '" + path.string() + "' has " +
                                                               std::to_string(n) + " bytes, more than the limit " +
                                                               std::to_string(max_bytes));
    return f.value().read(0, n);
}

}  // namespace io
KVCACHE_END_NAMESPACE
