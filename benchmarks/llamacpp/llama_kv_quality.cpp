// llama.cpp's side of benchmarks/paged_quality.py: teacher-forced perplexity of a GGUF on GIVEN token ids
// with a chosen KV cache type, and every position's next-token log-probs, so that the Python side computes
// the KL of one KV type against another on exactly the tokens the ortkv rows saw.
//
//   llama_kv_quality --model GGUF --ids FILE [--chunk 64] [--type-k f16] [--type-v f16] [--flash-attn on|off]
//                    [--threads T] [--logprobs-out FILE] [-v]
//
// --ids: whitespace-separated token ids (the Python side tokenizes; nothing is tokenized here, so both
// engines read the same ids). The ids are fed --chunk per llama_decode from position 0 in one sequence
// (n_ctx = the number of ids), logits for every position. --logprobs-out: float32 log-softmax rows
// [N, n_vocab], row t = log p(. | ids[0..t]), raw little-endian, written in order. The last stdout line is
// one JSON object: ppl (exp of the mean -log p(ids[t+1]) over t < N-1), n, n_vocab, type_k, type_v,
// flash_attn, n_ctx, kv_bytes (K + V at N tokens: per layer and token ggml_row_size(type, kv_heads x
// head_size) each, as llama.cpp sizes its cache rows), kv_bytes_allocated (the same at llama_n_ctx), seconds.
// A quantized V cache needs flash attention in llama.cpp; asking for one with --flash-attn off is refused.
// Build: benchmarks/llamacpp/build.sh (libraries and headers from benchmarks/llamacpp/fetch.sh).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"
#include "llama.h"

namespace {

[[noreturn]] void die(const std::string &msg) {
    std::fprintf(stderr, "llama_kv_quality: %s\n", msg.c_str());
    std::exit(1);
}

void quiet_log(ggml_log_level level, const char *text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

long parse_int(const char *flag, const char *value, long lo, long hi) {
    char *end = nullptr;
    long v = std::strtol(value, &end, 10);
    if (end == value || *end != '\0' || v < lo || v > hi)
        die(std::string(flag) + " " + value + ": give an integer from " + std::to_string(lo) + " to " +
            std::to_string(hi));
    return v;
}

// The KV cache types llama.cpp accepts (its common/arg.cpp kv_cache_types).
const ggml_type kKvTypes[] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q8_0,  GGML_TYPE_Q4_0,
                              GGML_TYPE_Q4_1, GGML_TYPE_IQ4_NL, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1};

ggml_type parse_type(const std::string &flag, const std::string &v) {
    std::string names;
    for (ggml_type t : kKvTypes) {
        if (v == ggml_type_name(t)) return t;
        names += std::string(names.empty() ? "" : ", ") + ggml_type_name(t);
    }
    die(flag + " " + v + ": not a KV cache type of llama.cpp; give one of " + names);
}

struct Args {
    std::string model, ids, logprobs_out;
    int chunk = 64, threads = 2;
    ggml_type type_k = GGML_TYPE_F16, type_v = GGML_TYPE_F16;
    bool flash_attn = true, verbose = false;
};

Args parse(int argc, char **argv) {
    Args a;
    for (int i = 1; i < argc; ++i) {
        std::string f = argv[i];
        auto value = [&]() -> const char * {
            if (i + 1 >= argc) die(f + " needs a value");
            return argv[++i];
        };
        if (f == "--model" || f == "-m") a.model = value();
        else if (f == "--ids") a.ids = value();
        else if (f == "--logprobs-out") a.logprobs_out = value();
        else if (f == "--chunk") a.chunk = (int)parse_int("--chunk", value(), 1, 1 << 16);
        else if (f == "--threads") a.threads = (int)parse_int("--threads", value(), 1, 1024);
        else if (f == "--type-k") a.type_k = parse_type(f, value());
        else if (f == "--type-v") a.type_v = parse_type(f, value());
        else if (f == "--flash-attn") {
            std::string v = value();
            if (v != "on" && v != "off") die("--flash-attn " + v + ": give on or off");
            a.flash_attn = v == "on";
        } else if (f == "-v") a.verbose = true;
        else if (f == "--help" || f == "-h") {
            std::printf("usage: %s --model GGUF --ids FILE [--chunk 64] [--type-k f16] [--type-v f16] "
                        "[--flash-attn on|off] [--threads T] [--logprobs-out FILE] [-v]\n", argv[0]);
            std::exit(0);
        } else die("unknown flag " + f + " (see --help)");
    }
    if (a.model.empty()) die("--model GGUF is required");
    if (a.ids.empty()) die("--ids FILE (whitespace-separated token ids) is required");
    if (!a.flash_attn && ggml_is_quantized(a.type_v))
        die(std::string("--type-v ") + ggml_type_name(a.type_v) +
            " with --flash-attn off: llama.cpp needs flash attention for a quantized V cache; use --flash-attn on");
    return a;
}

std::vector<llama_token> read_ids(const std::string &path, int n_vocab) {
    std::ifstream in(path);
    if (!in) die("cannot open --ids " + path);
    std::vector<llama_token> ids;
    long long v;
    while (in >> v) {
        if (v < 0 || v >= n_vocab)
            die("--ids " + path + ": token " + std::to_string(ids.size()) + " is " + std::to_string(v) +
                ", outside the model's vocabulary [0, " + std::to_string(n_vocab) + ")");
        ids.push_back((llama_token)v);
    }
    if (!in.eof()) die("--ids " + path + ": entry " + std::to_string(ids.size()) + " is not an integer");
    if (ids.size() < 2) die("--ids " + path + ": needs at least 2 ids, got " + std::to_string(ids.size()));
    return ids;
}

}  // namespace

int main(int argc, char **argv) {
    Args a = parse(argc, argv);
    if (!a.verbose) llama_log_set(quiet_log, nullptr);
    ggml_backend_load_all();  // the CPU variant libraries next to libggml (the build sets the rpath)
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.progress_callback = [](float, void *) { return true; };  // no progress dots on stderr
    llama_model *model = llama_model_load_from_file(a.model.c_str(), mp);
    if (!model) die("cannot load the GGUF " + a.model);
    const llama_vocab *vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    std::vector<llama_token> ids = read_ids(a.ids, n_vocab);
    const int N = (int)ids.size();

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)N;
    cp.n_batch = cp.n_ubatch = (uint32_t)a.chunk;
    cp.n_seq_max = 1;
    cp.n_threads = cp.n_threads_batch = a.threads;
    cp.flash_attn_type = a.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = a.type_k;
    cp.type_v = a.type_v;
    cp.no_perf = true;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create a context of n_ctx " + std::to_string(N) + " with K " + ggml_type_name(a.type_k) +
                  ", V " + ggml_type_name(a.type_v));

    std::FILE *out = nullptr;
    if (!a.logprobs_out.empty() && !(out = std::fopen(a.logprobs_out.c_str(), "wb")))
        die("cannot write --logprobs-out " + a.logprobs_out);
    llama_batch batch = llama_batch_init(a.chunk, 0, 1);
    std::vector<float> row(n_vocab);
    double nll = 0;
    const double t0 = now_s();
    for (int s = 0; s < N; s += a.chunk) {
        const int n = std::min(a.chunk, N - s);
        batch.n_tokens = n;
        for (int i = 0; i < n; ++i) {
            batch.token[i] = ids[s + i];
            batch.pos[i] = s + i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        if (int rc = llama_decode(ctx, batch))
            die("llama_decode (tokens " + std::to_string(s) + ".." + std::to_string(s + n) + ") returned " +
                std::to_string(rc));
        for (int i = 0; i < n; ++i) {
            const float *lg = llama_get_logits_ith(ctx, i);
            if (!lg) die("no logits for batch row " + std::to_string(i));
            double mx = *std::max_element(lg, lg + n_vocab), sum = 0;
            for (int v = 0; v < n_vocab; ++v) sum += std::exp((double)lg[v] - mx);
            const double lse = mx + std::log(sum);
            for (int v = 0; v < n_vocab; ++v) row[v] = (float)((double)lg[v] - lse);
            if (s + i + 1 < N) nll -= (double)lg[ids[s + i + 1]] - lse;
            if (out && std::fwrite(row.data(), sizeof(float), n_vocab, out) != (size_t)n_vocab)
                die("short write to --logprobs-out " + a.logprobs_out);
        }
        if (a.verbose) std::fprintf(stderr, "llama_kv_quality: %d/%d tokens\n", s + n, N);
    }
    const double seconds = now_s() - t0;
    llama_batch_free(batch);
    if (out && std::fclose(out) != 0) die("cannot close --logprobs-out " + a.logprobs_out);

    const long long n_layer = llama_model_n_layer(model), n_head = llama_model_n_head(model);
    const long long n_kv = llama_model_n_head_kv(model), n_embd = llama_model_n_embd(model);
    const long long row_kv = n_kv * (n_embd / n_head);
    const long long per_token = n_layer * (long long)(ggml_row_size(a.type_k, row_kv) + ggml_row_size(a.type_v, row_kv));
    std::printf("{\"ppl\": %.6f, \"n\": %d, \"n_vocab\": %d, \"type_k\": \"%s\", \"type_v\": \"%s\", "
                "\"flash_attn\": %s, \"chunk\": %d, \"threads\": %d, \"n_ctx\": %u, \"kv_bytes\": %lld, "
                "\"kv_bytes_allocated\": %lld, \"seconds\": %.3f}\n",
                std::exp(nll / (N - 1)), N, n_vocab, ggml_type_name(a.type_k), ggml_type_name(a.type_v),
                a.flash_attn ? "true" : "false", a.chunk, a.threads, llama_n_ctx(ctx), per_token * N,
                per_token * (long long)llama_n_ctx(ctx), seconds);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
