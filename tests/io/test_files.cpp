// Session files (F15): save_file / load_file round trips, crash-safe writes (temporary
// name + rename, nothing left behind), and unreadable paths refused with io_error while
// the cache stays unchanged.
#include <doctest/doctest.h>

#include <kvcache/kvcache.hpp>

#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <sys/resource.h>  // getrusage
#include <sys/stat.h>      // mkfifo
#include <unistd.h>    // geteuid, getpid

#include "io/io_test_util.hpp"
#include "support/cache_snapshot.hpp"

namespace {

using namespace kvtest;
namespace io = kvcache::io;
namespace fs = std::filesystem;
using kvcache::errc;
using kv_f16 = kvcache::kv_cache<kvcache::f16>;

/// A fresh scratch directory, removed at scope exit.
struct scratch_dir {
    fs::path path;
    scratch_dir() {
        path = fs::temp_directory_path() / ("kvcache_io_test_" + std::to_string(::getpid()));
        fs::remove_all(path);
        fs::create_directories(path);
    }
    ~scratch_dir() {
        std::error_code ec;
        fs::remove_all(path, ec);
    }
    [[nodiscard]] std::vector<std::string> names() const {
        std::vector<std::string> out;
        for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
        return out;
    }
};

kv_f16 filled(std::uint32_t seed) {
    kv_f16 c(io_shape(32, 2));
    std::mt19937 rng(seed);
    append(c, 0, 9, rng);
    append(c, 1, 4, rng);
    return c;
}

}  // namespace

TEST_CASE("session files round trip and leave no temporary file behind") {
    scratch_dir dir;
    const kv_f16 c = filled(1);
    const std::vector<kvcache::token_t> tokens{1, 2, 3, 4, 5, 6, 7, 8, 9};
    const fs::path whole = dir.path / "cache.kvst";
    const fs::path one = dir.path / "seq0.kvst";
    REQUIRE(io::save_file(c, whole, tokens).ok());
    REQUIRE(io::save_seq_file(c, 0, one, tokens).ok());
    CHECK(dir.names().size() == 2);

    kv_f16 d(io_shape(32, 2));
    auto r = io::load_file(d, whole);
    REQUIRE_MESSAGE(r.ok(), r.message());
    CHECK(r.value().tokens == tokens);
    CHECK(io::save_state(d, tokens) == io::save_state(c, tokens));
    kv_f16 e(io_shape(32, 2));
    auto r2 = io::load_seq_file(e, 1, one);
    REQUIRE_MESSAGE(r2.ok(), r2.message());
    CHECK(picture(e, 1, 1) == picture(c, 0, 1));

    // Overwriting replaces the file whole; still no temporary left.
    const kv_f16 c2 = filled(2);
    REQUIRE(io::save_file(c2, whole).ok());
    REQUIRE(io::load_file(d, whole).ok());
    CHECK(io::save_state(d) == io::save_state(c2));
    CHECK(dir.names().size() == 2);
}

TEST_CASE("unreadable paths and failed writes give io_error, the cache and old file unchanged") {
    scratch_dir dir;
    kv_f16 d = filled(3);
    const auto before = snapshot(d);
    auto refused = [&](const fs::path& p, const std::string& needle) {
        INFO(p.string());
        auto r = io::load_file(d, p);
        REQUIRE_FALSE(r.ok());
        CHECK_MESSAGE(r.code() == errc::io_error, r.message());
        CHECK_MESSAGE(r.message().find(needle) != std::string::npos, r.message());
        CHECK(r.message().find(p.filename().string()) != std::string::npos);
        auto r2 = io::load_seq_file(d, 0, p);
        CHECK(r2.code() == errc::io_error);
        CHECK(snapshot(d) == before);
    };
    refused(dir.path / "missing.kvst", "No such file");
    refused(dir.path, "is a directory");
    const fs::path fifo = dir.path / "fifo";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    refused(fifo, "not a regular file");
    if (::geteuid() != 0) {  // root reads files whatever their mode
        const fs::path locked = dir.path / "locked.kvst";
        REQUIRE(io::save_file(d, locked).ok());
        fs::permissions(locked, fs::perms::none);
        refused(locked, "cannot open");
    }
    // An empty file and a truncated one are read, then refused by the loader.
    const fs::path empty = dir.path / "empty.kvst";
    std::ofstream(empty).close();
    auto r = io::load_file(d, empty);
    CHECK(r.code() == errc::truncated);
    CHECK(snapshot(d) == before);

    // Writing into a missing directory fails cleanly; an existing file survives a failed write.
    const auto w = io::save_file(d, dir.path / "no_such_dir" / "x.kvst");
    CHECK(w.code() == errc::io_error);
    CHECK(w.message().find("no_such_dir") != std::string::npos);
    const fs::path keep = dir.path / "keep.kvst";
    REQUIRE(io::save_file(d, keep).ok());
    const auto old_size = fs::file_size(keep);
    fs::create_directory(dir.path / "blocker");
    // Renaming a file over a non-empty directory fails: the write reports it, leaves no temporary.
    std::ofstream(dir.path / "blocker" / "f").close();
    const auto w2 = io::save_file(d, dir.path / "blocker");
    CHECK(w2.code() == errc::io_error);
    CHECK(fs::file_size(keep) == old_size);
    for (const auto& n : dir.names()) CHECK(n.find(".tmp-") == std::string::npos);
}

namespace {

/// Peak resident set of this process, in bytes.
long peak_rss_bytes() {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss * 1024L;
}

/// A sparse file of `size` bytes whose first bytes are `head`.
void sparse_file(const fs::path& p, std::span<const std::byte> head, std::uint64_t size) {
    {
        std::ofstream f(p, std::ios::binary);
        f.write(reinterpret_cast<const char*>(head.data()), static_cast<std::streamsize>(head.size()));
    }
    fs::resize_file(p, size);
}

}  // namespace

TEST_CASE("load_file checks a file's header against the cache before reading it whole") {
    scratch_dir dir;
    const kv_f16 c = filled(3);
    kv_f16 d = filled(4);
    const auto before = snapshot(d);
    const std::vector<std::byte> good = io::save_state(c);
    constexpr std::uint64_t big = std::uint64_t{1} << 30;  // 1 GiB, sparse: costs no disk
    const long rss0 = peak_rss_bytes();
    auto expect_refused = [&](const fs::path& p, errc code, const std::string& text) {
        auto r = io::load_file(d, p);
        CHECK(r.code() == code);
        CHECK_MESSAGE(r.message().find(text) != std::string::npos, r.message());
        CHECK(snapshot(d) == before);
    };
    // Not a state at all: refused from its magic.
    const fs::path zeros = dir.path / "zeros.kvst";
    sparse_file(zeros, {}, big);
    expect_refused(zeros, errc::bad_magic, "magic");
    // A real header whose total_size says 1 GiB: its counts describe a few KiB.
    std::vector<std::byte> head(good.begin(), good.begin() + io::state_header_size);
    kvcache::io::detail::store_le<std::uint64_t>(head.data() + 8, big);
    const fs::path padded = dir.path / "padded.kvst";
    sparse_file(padded, head, big);
    expect_refused(padded, errc::trailing_bytes, "describe at most");
    // The same header claiming more cells than the cache has, in a file of the size it declares.
    std::vector<std::byte> many = head;
    kvcache::io::detail::store_le<std::uint64_t>(many.data() + 96, 1u << 20);
    const fs::path too_many = dir.path / "too_many.kvst";
    sparse_file(too_many, many, big);
    expect_refused(too_many, errc::no_space, "n_cells = 1048576 exceeds the capacity");
    // A header the cache refuses (another element type) is refused before the data.
    kvcache::kv_cache<kvcache::f32> e(io_shape(32, 2));
    const auto before_e = snapshot(e);
    auto r = io::load_file(e, padded);
    CHECK(r.code() == errc::dtype_mismatch);
    CHECK(snapshot(e) == before_e);
    // None of these read the gigabyte.
    CHECK(peak_rss_bytes() - rss0 < 256L * 1024 * 1024);
    // A good file still loads through the same path, whole and per sequence.
    const fs::path ok = dir.path / "ok.kvst";
    REQUIRE(io::save_file(c, ok).ok());
    auto l = io::load_file(d, ok);
    REQUIRE_MESSAGE(l.ok(), l.message());
    CHECK(snapshot(d) == snapshot(c));
    // load_seq_file: dst out of range is a programming error, staged placements too.
    CHECK_THROWS_AS(static_cast<void>(io::load_seq_file(d, 7, ok)), kvcache::error);
}
