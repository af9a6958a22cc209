// demo engine: tokenizers.
//
// - Byte level (the default): ids follow the Llama/SentencePiece byte-fallback convention,
//   0 = <unk>, 1 = <s> (BOS), 2 = </s> (EOS), byte b is token 3 + b. With a vocabulary
//   smaller than 259 the bytes wrap modulo the text range.
// - llama2.c's tokenizer.bin (with --tokenizer): int32 max_token_length, then per token a
//   float32 merge score, an int32 length and the token's bytes. Encoding splits the text
//   into UTF-8 characters (unknown ones fall back to byte tokens) and merges the adjacent
//   pair whose concatenation is the best-scoring vocabulary entry until none is left, with
//   SentencePiece's leading space, as llama2.c does.
#pragma once

#include <algorithm>      // std::min
#include <cstdint>        // std::int32_t
#include <cstdio>         // std::sscanf
#include <filesystem>     // paths
#include <fstream>        // tokenizer.bin
#include <string>         // text
#include <string_view>    // input
#include <unordered_map>  // piece -> id
#include <vector>         // token lists

#include <kvcache/tokens/token.hpp>

#include "model.hpp"

namespace demo {

using token_t = kvcache::token_t;

class tokenizer {
public:
    static constexpr token_t bos = 1;
    static constexpr token_t eos = 2;
    static constexpr token_t first_byte = 3;

    /// Byte-level tokenizer for a vocabulary of vocab_size >= 4 ids. Throws model_error otherwise.
    explicit tokenizer(int vocab_size) : vocab_size_(vocab_size) {
        if (vocab_size < 4)
            throw model_error("tokenizer: vocab_size = " + std::to_string(vocab_size) + ", must be >= 4");
    }

    /// Reads llama2.c's tokenizer.bin for a model of vocab_size tokens. Throws model_error with
    /// the file name and the offending entry when the file is missing, truncated or malformed.
    static tokenizer load_llama2c(const std::filesystem::path& path, int vocab_size) {
        tokenizer t(vocab_size);
        std::ifstream in(path, std::ios::binary);
        if (!in) throw model_error("tokenizer '" + path.string() + "': cannot open file");
        std::int32_t max_len = 0;
        if (!in.read(reinterpret_cast<char*>(&max_len), 4))
            throw model_error("tokenizer '" + path.string() + "': truncated header");
        if (max_len <= 0 || max_len > 1 << 16)
            throw model_error("tokenizer '" + path.string() + "': max_token_length = " + std::to_string(max_len) +
                              ", must be in [1, 65536]");
        t.pieces_.resize(static_cast<std::size_t>(vocab_size));
        t.scores_.resize(static_cast<std::size_t>(vocab_size));
        for (int i = 0; i < vocab_size; ++i) {
            std::int32_t len = 0;
            float score = 0;
            if (!in.read(reinterpret_cast<char*>(&score), 4) || !in.read(reinterpret_cast<char*>(&len), 4))
                throw model_error("tokenizer '" + path.string() + "': truncated at token " + std::to_string(i) +
                                  " of " + std::to_string(vocab_size));
            if (len < 0 || len > max_len)
                throw model_error("tokenizer '" + path.string() + "': token " + std::to_string(i) + " has length " +
                                  std::to_string(len) + ", must be in [0, max_token_length = " +
                                  std::to_string(max_len) + "]");
            std::string piece(static_cast<std::size_t>(len), '\0');
            if (!in.read(piece.data(), len))
                throw model_error("tokenizer '" + path.string() + "': truncated inside token " + std::to_string(i));
            t.scores_[static_cast<std::size_t>(i)] = score;
            t.ids_.emplace(piece, i);  // the first id wins for duplicate pieces
            t.pieces_[static_cast<std::size_t>(i)] = std::move(piece);
        }
        return t;
    }

    [[nodiscard]] bool byte_level() const noexcept { return pieces_.empty(); }
    [[nodiscard]] int vocab_size() const noexcept { return vocab_size_; }

    /// Text to tokens; with add_bos the list starts with <s>.
    [[nodiscard]] std::vector<token_t> encode(std::string_view text, bool add_bos) const {
        std::vector<token_t> out;
        if (add_bos) out.push_back(bos);
        if (byte_level()) {
            const int n_text = vocab_size_ - first_byte;
            for (unsigned char c : text) out.push_back(first_byte + static_cast<token_t>(c % n_text));
            return out;
        }
        std::vector<token_t> t;
        if (!text.empty()) lookup_or_bytes(" ", t);  // SentencePiece's dummy prefix
        for (std::size_t i = 0; i < text.size();) {
            std::size_t n = 1;  // one UTF-8 character: a lead byte and its continuation bytes
            while (i + n < text.size() && n < 4 && (static_cast<unsigned char>(text[i + n]) & 0xC0) == 0x80) ++n;
            lookup_or_bytes(text.substr(i, n), t);
            i += n;
        }
        for (;;) {  // merge the best-scoring adjacent pair until no pair is in the vocabulary
            float best_score = -1e30f;
            std::size_t best = t.size();
            token_t best_id = -1;
            for (std::size_t i = 0; i + 1 < t.size(); ++i) {
                const auto it = ids_.find(pieces_[static_cast<std::size_t>(t[i])] + pieces_[static_cast<std::size_t>(t[i + 1])]);
                if (it != ids_.end() && scores_[static_cast<std::size_t>(it->second)] > best_score) {
                    best_score = scores_[static_cast<std::size_t>(it->second)];
                    best = i;
                    best_id = it->second;
                }
            }
            if (best == t.size()) break;
            t[best] = best_id;
            t.erase(t.begin() + static_cast<std::ptrdiff_t>(best) + 1);
        }
        out.insert(out.end(), t.begin(), t.end());
        return out;
    }

    /// Token t as text, following token prev ("" for specials and unknown ids).
    [[nodiscard]] std::string piece(token_t prev, token_t t) const {
        if (t < 0 || t >= vocab_size_) return {};
        if (byte_level()) {
            if (t < first_byte || t - first_byte >= 256) return {};
            return std::string(1, static_cast<char>(t - first_byte));
        }
        std::string p = pieces_[static_cast<std::size_t>(t)];
        if (prev == bos && !p.empty() && p[0] == ' ') p.erase(0, 1);
        unsigned byte = 0;
        if (p.size() == 6 && std::sscanf(p.c_str(), "<0x%02X>", &byte) == 1) return std::string(1, static_cast<char>(byte));
        if (t < first_byte) return {};
        return p;
    }

    /// Tokens to text.
    [[nodiscard]] std::string decode(const std::vector<token_t>& tokens) const {
        std::string s;
        token_t prev = -1;
        for (token_t t : tokens) {
            s += piece(prev, t);
            prev = t;
        }
        return s;
    }

private:
    void lookup_or_bytes(std::string_view s, std::vector<token_t>& out) const {
        const auto it = ids_.find(std::string(s));
        if (it != ids_.end()) {
            out.push_back(it->second);
            return;
        }
        for (unsigned char c : s) out.push_back(std::min<token_t>(first_byte + c, vocab_size_ - 1));
    }

    int vocab_size_;
    // llama2.c vocabulary (empty: byte level). pieces_[id], scores_[id]; ids_ maps a piece to its id.
    std::vector<std::string> pieces_;
    std::vector<float> scores_;
    std::unordered_map<std::string, token_t> ids_;
};

}  // namespace demo
