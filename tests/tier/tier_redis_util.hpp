// Helpers of the Redis tier tests: redis-server child processes on loopback ports the test
// chooses, a raw hiredis connection, a 3-node cluster built with redis-cli.
#pragma once

#include <kvcache/tier/redis_tier.hpp>

#if KVCACHE_HAS_REDIS_TIER
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace tiertest {

/// Whether `prog` is an executable on PATH.
inline bool redis_on_path(const std::string& prog) {
    const char* path = std::getenv("PATH");
    if (path == nullptr) return false;
    std::string all(path);
    for (std::size_t b = 0; b <= all.size();) {
        const std::size_t e = std::min(all.find(':', b), all.size());
        if (::access((all.substr(b, e - b) + "/" + prog).c_str(), X_OK) == 0) return true;
        b = e + 1;
    }
    return false;
}

/// A raw connection for checks (nullptr reply on failure).
struct redis_raw {
    redisContext* c = nullptr;
    explicit redis_raw(int port) {
        timeval tv{1, 0};
        c = redisConnectWithTimeout("127.0.0.1", port, tv);
        if (c != nullptr && c->err == 0) redisSetTimeout(c, tv);
    }
    ~redis_raw() {
        if (c != nullptr) redisFree(c);
    }
    redis_raw(const redis_raw&) = delete;
    redis_raw& operator=(const redis_raw&) = delete;
    bool ok() const { return c != nullptr && c->err == 0; }
    /// Runs a command given as words; returns the reply as text ("" on failure; integers as digits).
    std::string cmd(const std::vector<std::string>& words) {
        if (!ok()) return "";
        std::vector<const char*> argv;
        std::vector<std::size_t> len;
        for (const auto& w : words) {
            argv.push_back(w.data());
            len.push_back(w.size());
        }
        auto* r = static_cast<redisReply*>(redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), len.data()));
        if (r == nullptr) return "";
        std::string out;
        if (r->type == REDIS_REPLY_INTEGER) out = std::to_string(r->integer);
        else if (r->str != nullptr) out.assign(r->str, r->len);
        freeReplyObject(r);
        return out;
    }
};

/// A redis-server child process on 127.0.0.1:port (killed by the destructor).
struct redis_server {
    pid_t pid = -1;
    int port = 0;
    std::string dir;
    redis_server() = default;
    redis_server(const redis_server&) = delete;
    redis_server& operator=(const redis_server&) = delete;
    ~redis_server() { stop(); }

    /// Starts on `port`; true when it answers PING within 5 s.
    bool start(int p, const std::string& scratch, bool cluster) {
        port = p;
        dir = scratch + "/node" + std::to_string(p);
        std::filesystem::create_directories(dir);
        pid = ::fork();
        if (pid == 0) {
            const std::string ps = std::to_string(p);
            // dup2, not freopen: freopen would flush the parent's buffered output a second time.
            const int null_fd = ::open("/dev/null", O_WRONLY);
            if (null_fd < 0 || ::dup2(null_fd, 1) < 0) ::_exit(126);
            std::vector<const char*> a = {"redis-server", "--port", ps.c_str(), "--bind", "127.0.0.1", "--save", "",
                                          "--appendonly", "no", "--daemonize", "no", "--dir", dir.c_str()};
            if (cluster) {
                a.push_back("--cluster-enabled");
                a.push_back("yes");
                a.push_back("--cluster-node-timeout");
                a.push_back("2000");
            }
            a.push_back(nullptr);
            ::execvp("redis-server", const_cast<char* const*>(a.data()));
            ::_exit(127);
        }
        for (int i = 0; i < 100; ++i) {
            std::this_thread::sleep_for(std::chrono::milliseconds(50));
            int st = 0;
            if (::waitpid(pid, &st, WNOHANG) == pid) {  // exited: port taken?
                pid = -1;
                return false;
            }
            redis_raw r(p);
            if (r.cmd({"PING"}) == "PONG") return true;
        }
        stop();
        return false;
    }
    void stop() {
        if (pid > 0) {
            ::kill(pid, SIGKILL);
            ::waitpid(pid, nullptr, 0);
        }
        pid = -1;
    }
};

/// Starts a server on a port chosen from the process id (tries a few).
inline bool redis_start_any(redis_server& s, const std::string& scratch, bool cluster, int salt = 0) {
    for (int attempt = 0; attempt < 8; ++attempt) {
        const int p = 21000 + static_cast<int>((static_cast<unsigned>(::getpid()) * 13u + static_cast<unsigned>(salt) * 1009u +
                                                 static_cast<unsigned>(attempt) * 2003u) % 30000u);
        if (s.start(p, scratch, cluster)) return true;
    }
    return false;
}

}  // namespace tiertest
#endif
