// llama.cpp's side of `ortkv bench --cpu-baseline llamacpp` (and of the GPU bench's llama.cpp row):
// load a GGUF, prefill B sequences of one prompt of P tokens in ONE llama_batch, then greedy-decode the B
// sequences together, one llama_batch of B tokens per step, and print one JSON line.
//
//   llama_decode_bench --model GGUF --batch B --prompt-tokens P --new-tokens N --ctx MAX_LENGTH
//                      [--threads T] [--flash-attn on|off] [--no-warmup]
//
// The contract (Note [llama.cpp hook] in python/ortkv/generate/bench.py): the last stdout line is a JSON
// object with prefill_tok_s and decode_tok_s (all sequences), here also median_step_ms, mean_step_ms,
// kv_bytes, threads, and the first sequence's new token ids. Counting matches ortkv's (loop.py): the first
// new token comes from the prefill's logits, then N - 1 decode steps of B tokens each; decode_tok_s =
// (N - 1) * B / decode seconds. Each sequence gets MAX_LENGTH positions: n_ctx = MAX_LENGTH * B, one KV
// stream per sequence (kv_unified off), the KV cache in f16 (llama.cpp's default). An untimed warm-up
// (prefill + one step, then the cache cleared) runs first unless --no-warmup.
// Build: benchmarks/llamacpp/build.sh (libraries and headers from benchmarks/llamacpp/fetch.sh).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "llama.h"

namespace {

const char *kText =
    "ONNX Runtime runs models exported from many frameworks. A key-value cache stores the keys and values "
    "of every token a language model has seen, so that each new token attends to the past without "
    "recomputing it. Updating that cache in place, without a second cache-sized buffer, is what this "
    "benchmark measures, side by side with onnxruntime-genai and a plain copy. ";

[[noreturn]] void die(const std::string &msg) {
    std::fprintf(stderr, "llama_decode_bench: %s\n", msg.c_str());
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

struct Args {
    std::string model;
    int batch = 1, prompt_tokens = 16, new_tokens = 128, ctx = 2048, threads = 2;
    bool flash_attn = false, warmup = true, verbose = false;
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
        else if (f == "--batch") a.batch = (int)parse_int("--batch", value(), 1, 4096);
        else if (f == "--prompt-tokens") a.prompt_tokens = (int)parse_int("--prompt-tokens", value(), 1, 1 << 20);
        else if (f == "--new-tokens") a.new_tokens = (int)parse_int("--new-tokens", value(), 1, 1 << 20);
        else if (f == "--ctx") a.ctx = (int)parse_int("--ctx", value(), 2, 1 << 22);
        else if (f == "--threads") a.threads = (int)parse_int("--threads", value(), 1, 1024);
        else if (f == "--flash-attn") {
            std::string v = value();
            if (v != "on" && v != "off") die("--flash-attn " + v + ": give on or off");
            a.flash_attn = v == "on";
        } else if (f == "--no-warmup") a.warmup = false;
        else if (f == "-v") a.verbose = true;
        else if (f == "--help" || f == "-h") {
            std::printf("usage: %s --model GGUF [--batch B] [--prompt-tokens P] [--new-tokens N] [--ctx MAX_LENGTH]"
                        " [--threads T] [--flash-attn on|off] [--no-warmup] [-v]\n", argv[0]);
            std::exit(0);
        } else die("unknown flag " + f + " (see --help)");
    }
    if (a.model.empty()) die("--model GGUF is required");
    if (a.prompt_tokens + a.new_tokens > a.ctx)
        die("--prompt-tokens " + std::to_string(a.prompt_tokens) + " + --new-tokens " + std::to_string(a.new_tokens) +
            " exceed --ctx " + std::to_string(a.ctx) + ": raise --ctx or generate fewer tokens");
    return a;
}

std::vector<llama_token> make_prompt(const llama_vocab *vocab, int n) {
    std::string text;
    std::vector<llama_token> ids;
    while ((int)ids.size() < n) {
        text += kText;
        ids.assign(text.size() + 8, 0);
        int got = llama_tokenize(vocab, text.c_str(), (int32_t)text.size(), ids.data(), (int32_t)ids.size(),
                                 /*add_special=*/true, /*parse_special=*/false);
        if (got < 0) die("llama_tokenize failed");
        ids.resize(got);
    }
    ids.resize(n);
    return ids;
}

llama_token argmax(const float *logits, int n_vocab) {
    return (llama_token)(std::max_element(logits, logits + n_vocab) - logits);
}

struct Run {
    double prefill_s = 0, decode_s = 0;
    std::vector<double> steps;
    std::vector<llama_token> seq0;
};

Run generate(llama_context *ctx, const llama_vocab *vocab, const std::vector<llama_token> &prompt, int B, int N) {
    const int P = (int)prompt.size(), n_vocab = llama_vocab_n_tokens(vocab);
    llama_memory_clear(llama_get_memory(ctx), true);
    llama_batch batch = llama_batch_init(std::max(P * B, B), 0, 1);
    batch.n_tokens = 0;
    for (int s = 0; s < B; ++s)
        for (int t = 0; t < P; ++t) {
            int i = batch.n_tokens++;
            batch.token[i] = prompt[t];
            batch.pos[i] = t;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = s;
            batch.logits[i] = t == P - 1;
        }
    Run r;
    double t0 = now_s();
    if (int rc = llama_decode(ctx, batch)) die("llama_decode (prefill of " + std::to_string(P * B) + " tokens) returned " + std::to_string(rc));
    r.prefill_s = now_s() - t0;
    std::vector<llama_token> next(B);
    for (int s = 0; s < B; ++s) next[s] = argmax(llama_get_logits_ith(ctx, s * P + P - 1), n_vocab);
    r.seq0.push_back(next[0]);
    double d0 = now_s();
    for (int step = 1; step < N; ++step) {
        batch.n_tokens = B;
        for (int s = 0; s < B; ++s) {
            batch.token[s] = next[s];
            batch.pos[s] = P + step - 1;
            batch.n_seq_id[s] = 1;
            batch.seq_id[s][0] = s;
            batch.logits[s] = 1;
        }
        double ts = now_s();
        if (int rc = llama_decode(ctx, batch)) die("llama_decode (step " + std::to_string(step) + ") returned " + std::to_string(rc));
        for (int s = 0; s < B; ++s) next[s] = argmax(llama_get_logits_ith(ctx, s), n_vocab);
        r.steps.push_back(now_s() - ts);
        r.seq0.push_back(next[0]);
    }
    r.decode_s = now_s() - d0;
    llama_batch_free(batch);
    return r;
}

}  // namespace

int main(int argc, char **argv) {
    Args a = parse(argc, argv);
    if (!a.verbose) llama_log_set(quiet_log, nullptr);
    ggml_backend_load_all();  // the CPU variant libraries next to libggml (the build sets the rpath)
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model *model = llama_model_load_from_file(a.model.c_str(), mp);
    if (!model) die("cannot load the GGUF " + a.model);
    const llama_vocab *vocab = llama_model_get_vocab(model);
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)a.ctx * (uint32_t)a.batch;
    cp.n_batch = cp.n_ubatch = (uint32_t)std::max(a.prompt_tokens * a.batch, a.batch);
    cp.n_seq_max = (uint32_t)a.batch;
    cp.kv_unified = false;
    cp.n_threads = cp.n_threads_batch = a.threads;
    cp.flash_attn_type = a.flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.no_perf = true;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) die("cannot create a context of n_ctx " + std::to_string(cp.n_ctx));
    std::vector<llama_token> prompt = make_prompt(vocab, a.prompt_tokens);
    if (a.warmup) generate(ctx, vocab, prompt, a.batch, 2);
    Run r = generate(ctx, vocab, prompt, a.batch, a.new_tokens);
    std::vector<double> st = r.steps;
    std::sort(st.begin(), st.end());
    double median = st.empty() ? 0 : (st.size() % 2 ? st[st.size() / 2] : 0.5 * (st[st.size() / 2 - 1] + st[st.size() / 2]));
    double mean = 0;
    for (double s : st) mean += s;
    mean = st.empty() ? 0 : mean / st.size();
    // f16 K and V: n_ctx cells x layers x (head_size x kv_heads) x 2 bytes, twice
    const long long n_layer = llama_model_n_layer(model), n_head = llama_model_n_head(model);
    const long long n_kv = llama_model_n_head_kv(model), n_embd = llama_model_n_embd(model);
    long long kv_bytes = 2LL * (long long)cp.n_ctx * n_layer * (n_embd / n_head) * n_kv * 2LL;
    std::printf("{\"prefill_tok_s\": %.3f, \"decode_tok_s\": %.3f, \"median_step_ms\": %.4f, \"mean_step_ms\": %.4f, "
                "\"kv_bytes\": %lld, \"batch\": %d, \"prompt_tokens\": %d, \"new_tokens\": %d, \"ctx\": %d, "
                "\"threads\": %d, \"flash_attn\": %s, \"new_ids_0\": [",
                (double)a.prompt_tokens * a.batch / r.prefill_s,
                r.decode_s > 0 ? (double)(a.new_tokens - 1) * a.batch / r.decode_s : 0.0, 1e3 * median, 1e3 * mean,
                kv_bytes, a.batch, a.prompt_tokens, a.new_tokens, a.ctx, a.threads, a.flash_attn ? "true" : "false");
    for (size_t i = 0; i < r.seq0.size(); ++i) std::printf("%s%d", i ? ", " : "", r.seq0[i]);
    std::printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
