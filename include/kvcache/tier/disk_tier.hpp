// kvcache tier: disk_tier, blobs as files of one directory, shared by every process that
// opens it and surviving restarts.
//
// Files: <dir>/<key hex>.kvtb holds one blob (tier/blob.hpp). A put writes
// <dir>/.tmp-<pid>-<n>-<key hex>, fsyncs it, renames it over the final name (atomic: a
// reader sees the old blob or the new one, never a torn one) and fsyncs the directory.
// The last access is the file's mtime (set by put and by every get), the LRU order of the
// byte limit; any process may evict any file. Readers keep their open file when another
// process replaces or evicts it (POSIX unlink semantics), so processes never see a
// half-written blob. map() reads a blob in place (a read-only mapping of its file, no
// copy); if something outside the library truncates a mapped file in place, reading it
// raises SIGBUS (tier/mapped_blob.hpp). A blob corrupted in place (bit rot, a copy cut short) is refused by
// tier_cache's verification and erased.
//
// Index: the files' sizes, built lazily: the first call lists the directory; each later
// call checks the headers of up to scan_batch listed files (magic, version, size equal to
// the file's), removing bad ones and temporary files older than tmp_max_age (left by a
// crashed writer). scan_all() finishes the scan. So opening a large directory costs one
// readdir, and no call does more than scan_batch header reads.
// Thread safety: not thread-safe (one object per thread); processes may share the directory.
#pragma once

#include <dirent.h>    // opendir, readdir
#include <fcntl.h>     // open
#include <sys/mman.h>  // mmap
#include <sys/stat.h>  // stat, futimens
#include <unistd.h>    // read, write, fsync, unlink, getpid

#include <algorithm>      // std::sort
#include <cerrno>         // errno
#include <cstddef>        // std::byte, std::size_t
#include <cstdint>        // fixed-width integers
#include <cstring>        // std::strerror
#include <ctime>          // time
#include <span>           // blob bytes
#include <string>         // paths
#include <string_view>    // name
#include <tuple>          // eviction order
#include <unordered_map>  // index
#include <vector>         // pending names, blob bytes

#include "../error.hpp"
#include "blob.hpp"
#include "buffer.hpp"
#include "key.hpp"
#include "mapped_blob.hpp"

KVCACHE_BEGIN_NAMESPACE
namespace tier {

/// Options of a disk_tier.
struct disk_tier_options {
    /// Byte limit of the directory (all processes together); 0 = none.
    std::size_t limit_bytes = 0;
    /// Listed files whose header each call checks while the lazy scan runs.
    std::size_t scan_batch = 256;
    /// Temporary files older than this (seconds) are left by a crashed writer: removed.
    std::int64_t tmp_max_age_s = 600;
    /// fsync the file and the directory on every put (off: faster, a power loss may lose blobs).
    bool sync = true;
};

/// Counters of a disk_tier (this process's view).
struct disk_tier_stats {
    std::uint64_t corrupt_removed = 0;  ///< files removed: bad header or size (torn, truncated, foreign)
    std::uint64_t stale_tmp_removed = 0;  ///< temporary files of crashed writers removed
    std::uint64_t evictions = 0;        ///< files removed by the byte limit
    std::uint64_t io_errors = 0;        ///< puts or reads that failed with an I/O error
    std::uint64_t scanned = 0;          ///< headers checked by the lazy scan
};

/// Blobs as files of one directory (see above).
class disk_tier {
public:
    /// Opens (and creates, with its parents) directory `dir`. Throws kvcache::error
    /// (io_error) when it cannot be created, (invalid_argument) for an empty path.
    explicit disk_tier(std::string dir, disk_tier_options opt = {}) : dir_(std::move(dir)), opt_(opt) {
        if (dir_.empty()) kvcache::detail::fail(errc::invalid_argument, "disk_tier: dir is empty");
        while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
        for (std::size_t i = 1; i <= dir_.size(); ++i)
            if (i == dir_.size() || dir_[i] == '/') {
                const std::string part = dir_.substr(0, i);
                if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
                    kvcache::detail::fail(errc::io_error, "disk_tier: cannot create \"" + part + "\": " + std::strerror(errno));
            }
        struct stat st{};
        if (::stat(dir_.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
            kvcache::detail::fail(errc::io_error, "disk_tier: \"" + dir_ + "\" is not a directory");
    }

    result<void> put(const key& k, std::span<const std::byte> blob) {
        step_scan();
        const std::string hex = k.hex();
        const std::string tmp = dir_ + "/.tmp-" + std::to_string(::getpid()) + "-" + std::to_string(++tmp_counter_) + "-" + hex;
        const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0) return io_fail("put: cannot create " + tmp);
        std::size_t done = 0;
        while (done < blob.size()) {
            const ::ssize_t w = ::write(fd, blob.data() + done, blob.size() - done);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) {
                const int e = errno;
                ::close(fd);
                ::unlink(tmp.c_str());
                errno = e;
                return io_fail("put: cannot write " + tmp);
            }
            done += static_cast<std::size_t>(w);
        }
        if ((opt_.sync && ::fsync(fd) != 0) || ::close(fd) != 0) {
            ::unlink(tmp.c_str());
            return io_fail("put: cannot sync " + tmp);
        }
        const std::string path = file_of(hex);
        if (::rename(tmp.c_str(), path.c_str()) != 0) {
            ::unlink(tmp.c_str());
            return io_fail("put: cannot rename to " + path);
        }
        if (opt_.sync) sync_dir();
        set_size(hex, blob.size());
        if (opt_.limit_bytes > 0 && bytes_ > opt_.limit_bytes) enforce_limit(hex);
        return {};
    }

    bool get(const key& k, std::vector<std::byte>& out) {
        step_scan();
        const std::string hex = k.hex();
        const std::string path = file_of(hex);
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            if (errno != ENOENT) ++stats_.io_errors;
            forget(hex);
            return false;
        }
        struct stat st{};
        bool ok = ::fstat(fd, &st) == 0;
        const auto size = ok ? static_cast<std::size_t>(st.st_size) : 0;
        if (ok) {
            kvcache::detail::resize_blob_buffer(out, size);
            std::size_t done = 0;
            while (ok && done < size) {
                const ::ssize_t r = ::read(fd, out.data() + done, size - done);
                if (r < 0 && errno == EINTR) continue;
                if (r <= 0) ok = false;
                else done += static_cast<std::size_t>(r);
            }
            if (!ok) ++stats_.io_errors;
        }
        if (ok) ::futimens(fd, nullptr);  // last access = now (LRU)
        ::close(fd);
        if (!ok) return false;
        blob_header h;
        if (read_blob_header(out, h) != refusal::none || h.total_size != size) {
            remove_corrupt(hex);
            return false;
        }
        set_size(hex, size);
        return true;
    }

    /// As get, reading the file in place: a read-only mapping of it (pages populated from
    /// the page cache, no copy into a buffer), owned by `out`. The file's header is checked
    /// as by get (a bad one is removed); the mapping stays valid when the file is replaced
    /// or removed meanwhile, not when it is truncated in place (SIGBUS, see above).
    bool map(const key& k, mapped_blob& out) {
        step_scan();
        out.reset();
        const std::string hex = k.hex();
        const int fd = ::open(file_of(hex).c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            if (errno != ENOENT) ++stats_.io_errors;
            forget(hex);
            return false;
        }
        struct stat st{};
        const bool stat_ok = ::fstat(fd, &st) == 0;
        const auto size = stat_ok ? static_cast<std::size_t>(st.st_size) : 0;
        void* addr = MAP_FAILED;
        if (size >= blob_header_size) {
            int flags = MAP_PRIVATE;
#ifdef MAP_POPULATE
            flags |= MAP_POPULATE;  // the verification reads every byte: map the pages at once
#endif
            addr = ::mmap(nullptr, size, PROT_READ, flags, fd, 0);
            if (addr == MAP_FAILED) ++stats_.io_errors;
            else ::futimens(fd, nullptr);  // last access = now (LRU)
        } else if (!stat_ok) {
            ++stats_.io_errors;
        }
        ::close(fd);
        if (addr == MAP_FAILED) {
            if (stat_ok && size < blob_header_size) remove_corrupt(hex);
            return false;
        }
        mapped_blob m = mapped_blob::adopt_mapping(addr, size);
        blob_header h;
        if (read_blob_header(m.bytes(), h) != refusal::none || h.total_size != size) {
            m.reset();
            remove_corrupt(hex);
            return false;
        }
        set_size(hex, size);
        out = std::move(m);
        return true;
    }

    [[nodiscard]] bool contains(const key& k) const {
        struct stat st{};
        return ::stat(file_of(k.hex()).c_str(), &st) == 0;
    }
    bool erase(const key& k) {
        const std::string hex = k.hex();
        forget(hex);
        return ::unlink(file_of(hex).c_str()) == 0;
    }
    /// Bytes of the files this process knows of (the whole directory once scan_all() ran).
    [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
    /// Files this process knows of.
    [[nodiscard]] std::size_t size() const noexcept { return index_.size(); }
    [[nodiscard]] std::string_view name() const noexcept { return "disk"; }
    [[nodiscard]] const disk_tier_stats& stats() const noexcept { return stats_; }
    [[nodiscard]] const std::string& dir() const noexcept { return dir_; }
    /// Path of the file of key k.
    [[nodiscard]] std::string path_of(const key& k) const { return file_of(k.hex()); }

    /// Finishes the lazy scan (checks every listed file's header).
    void scan_all() {
        step_scan();
        while (!pending_.empty()) step_scan();
    }

private:
    static constexpr std::string_view ext = ".kvtb";
    [[nodiscard]] std::string file_of(const std::string& hex) const { return dir_ + "/" + hex + std::string(ext); }

    result<void> io_fail(const std::string& what) {
        ++stats_.io_errors;
        return kvcache::detail::make_error(errc::io_error, "disk_tier::" + what + ": " + std::strerror(errno));
    }
    void sync_dir() const {
        const int d = ::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (d >= 0) {
            ::fsync(d);
            ::close(d);
        }
    }
    void set_size(const std::string& hex, std::size_t size) {
        auto [it, fresh] = index_.try_emplace(hex, size);
        if (!fresh) bytes_ -= it->second;
        it->second = size;
        bytes_ += size;
    }
    void forget(const std::string& hex) {
        const auto it = index_.find(hex);
        if (it == index_.end()) return;
        bytes_ -= it->second;
        index_.erase(it);
    }
    void remove_corrupt(const std::string& hex) {
        forget(hex);
        if (::unlink(file_of(hex).c_str()) == 0) ++stats_.corrupt_removed;
    }

    /// One directory entry: (mtime ns, name, size); is_tmp for a writer's temporary file.
    struct listed {
        std::int64_t mtime_ns = 0;
        std::string name;
        std::size_t size = 0;
    };
    std::vector<listed> list_dir(bool with_tmp) const {
        std::vector<listed> out;
        DIR* d = ::opendir(dir_.c_str());
        if (d == nullptr) return out;
        while (const dirent* e = ::readdir(d)) {
            const std::string_view n(e->d_name);
            const bool tmp = n.starts_with(".tmp-");
            if (!tmp && !(n.size() == 64 + ext.size() && n.ends_with(ext))) continue;
            if (tmp && !with_tmp) continue;
            struct stat st{};
            if (::stat((dir_ + "/" + std::string(n)).c_str(), &st) != 0) continue;  // removed meanwhile
            out.push_back(listed{std::int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec, std::string(n),
                                 static_cast<std::size_t>(st.st_size)});
        }
        ::closedir(d);
        return out;
    }

    /// First call: lists the directory; later calls: checks up to scan_batch listed files.
    void step_scan() {
        if (!listed_) {
            listed_ = true;
            pending_ = list_dir(true);
            return;
        }
        const std::int64_t now_s = static_cast<std::int64_t>(::time(nullptr));
        for (std::size_t i = 0; i < opt_.scan_batch && !pending_.empty(); ++i) {
            const listed f = std::move(pending_.back());
            pending_.pop_back();
            const std::string path = dir_ + "/" + f.name;
            if (f.name.starts_with(".tmp-")) {
                if (now_s - f.mtime_ns / 1000000000 > opt_.tmp_max_age_s && ::unlink(path.c_str()) == 0)
                    ++stats_.stale_tmp_removed;
                continue;
            }
            ++stats_.scanned;
            const std::string hex = f.name.substr(0, 64);
            const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
            if (fd < 0) continue;  // evicted or replaced meanwhile
            std::byte head[blob_header_size];
            struct stat st{};
            const bool have = ::fstat(fd, &st) == 0 && ::read(fd, head, sizeof head) == static_cast<::ssize_t>(sizeof head);
            ::close(fd);
            blob_header h;
            if (!have || read_blob_header(std::span<const std::byte>(head, sizeof head), h) != refusal::none ||
                h.total_size != static_cast<std::uint64_t>(st.st_size) || h.k.hex() != hex)
                remove_corrupt(hex);
            else
                set_size(hex, static_cast<std::size_t>(st.st_size));
        }
    }

    /// Lists the directory (every process's files) and removes the least recently used
    /// until the byte limit holds, sparing `keep` (the blob just written) if it can.
    void enforce_limit(const std::string& keep) {
        std::vector<listed> files = list_dir(false);
        std::size_t total = 0;
        for (const listed& f : files) total += f.size;
        std::sort(files.begin(), files.end(),
                  [](const listed& a, const listed& b) { return std::tie(a.mtime_ns, a.name) < std::tie(b.mtime_ns, b.name); });
        index_.clear();
        bytes_ = 0;
        for (const listed& f : files) {
            const std::string hex = f.name.substr(0, 64);
            if (total > opt_.limit_bytes && hex != keep) {
                if (::unlink((dir_ + "/" + f.name).c_str()) == 0) ++stats_.evictions;
                total -= f.size;  // gone (by us or by another process)
                continue;
            }
            set_size(hex, f.size);
        }
    }

    std::string dir_;
    disk_tier_options opt_;
    disk_tier_stats stats_;
    std::unordered_map<std::string, std::size_t> index_;  // key hex -> file size
    std::size_t bytes_ = 0;
    bool listed_ = false;
    std::vector<listed> pending_;  // listed files whose header is not checked yet
    std::uint64_t tmp_counter_ = 0;
};

}  // namespace tier
KVCACHE_END_NAMESPACE
