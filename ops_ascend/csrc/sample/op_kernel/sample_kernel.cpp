/*
 * deepinfer_ascend::sample: seeded temperature / top-k / top-p / min-p sampling, one row per pass of a
 * vector core, deterministic (no atomics, fixed reduction order) and graph-capturable (every input is
 * read from device memory; only the shapes are kernel arguments).
 *
 * Semantics (deepinfer.backends.ops.sample; reference: deepinfer/backends/reference/sampling.py):
 *   temperature 0 -> argmax of the logits (lowest id among equal maxima);
 *   else lp = log_softmax(logits / T); a token is allowed when it is among the top_k by rank (ties by
 *   lower id), inside the top_p nucleus of the top-k renormalised distribution (the smallest prefix in
 *   descending probability, ties by lower id, whose mass reaches top_p), and p >= min_p * max p; the
 *   result is argmax over allowed tokens of lp + g, g = -ln(-ln(u)), u = counter_uniform(seed, offset,
 *   token) computed bit-exactly as the reference does (32-bit integer hash).
 *
 * Method, per row (logits streamed from global memory in UB chunks, see ../op_host/sample_tiling.h):
 *   1. m = max(x), s = sum(exp(x - m)) with x = logits / T; lp = (x - m) - ln(s).
 *   2. Thresholds without sorting: tokens are ordered by the monotone 32-bit key of their float lp. The
 *      top-k cut is the largest key K with count(lp >= K) >= k, found by bisection over keys (32 passes);
 *      the tokens strictly above K are kept, plus the k - count(lp > K) lowest-id tokens equal to K. The
 *      top-p cut is the smallest key K' >= K with mass(lp > K') < top_p * Z (Z: the top-k mass), by
 *      bisection on masses; tokens equal to K' are kept in id order while the mass before them is below
 *      the target. Inactive filters cost no pass.
 *   3. A final pass computes the noise, masks the disallowed tokens to -inf and keeps the first maximum.
 */
#include "kernel_operator.h"

using namespace AscendC;

namespace {

constexpr uint32_t kNegInfKey = 0x007FFFFFu;  // order key of -inf
constexpr uint32_t kPosInfKey = 0xFF800000u;  // order key of +inf
constexpr uint32_t kScalarLanes = 64;         // one 256-byte repeat of float32
constexpr float kTwoPowMinus23 = 1.0f / 8388608.0f;

__aicore__ inline float BitsToFloat(uint32_t bits)
{
    union {
        uint32_t u;
        float f;
    } v;
    v.u = bits;
    return v.f;
}

__aicore__ inline uint32_t FloatToBits(float value)
{
    union {
        float f;
        uint32_t u;
    } v;
    v.f = value;
    return v.u;
}

// Order-preserving map between float32 values and uint32 keys (larger key <=> larger float).
__aicore__ inline float KeyValue(uint32_t key)
{
    return BitsToFloat((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

__aicore__ inline uint32_t OrderKey(float value)
{
    uint32_t bits = FloatToBits(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Wellons' lowbias32, as deepinfer.backends.reference.sampling.mix32.
__aicore__ inline uint32_t Mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

// key = mix32(mix32(seed_lo ^ mix32(seed_hi)) ^ offset_lo), as counter_uniform.
__aicore__ inline uint32_t RowKey(int64_t seed, int64_t offset)
{
    uint64_t s = static_cast<uint64_t>(seed);
    uint32_t seedKey = Mix32(static_cast<uint32_t>(s) ^ Mix32(static_cast<uint32_t>(s >> 32)));
    return Mix32(seedKey ^ static_cast<uint32_t>(static_cast<uint64_t>(offset)));
}

template <HardEvent EVENT>
__aicore__ inline void Wait()
{
    event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(EVENT));
    SetFlag<EVENT>(id);
    WaitFlag<EVENT>(id);
}

struct CountMass {
    float count;
    float mass;
};

class SampleKernel {
public:
    __aicore__ inline void Init(GM_ADDR logits, GM_ADDR temperature, GM_ADDR topK, GM_ADDR topP, GM_ADDR minP,
                                GM_ADDR seeds, GM_ADDR offsets, GM_ADDR out, uint32_t rows, uint32_t vocab,
                                uint32_t chunk, uint32_t chunks)
    {
        rows_ = rows;
        vocab_ = vocab;
        chunk_ = chunk;
        chunks_ = chunks;
        logitsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(logits));
        temperatureGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(temperature));
        topKGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int32_t *>(topK));
        topPGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(topP));
        minPGm_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(minP));
        seedsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(seeds));
        offsetsGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(offsets));
        outGm_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(out));

        uint32_t bytes = chunk * sizeof(float);
        uint32_t maskBytes = chunk / 8 < 256 ? 256 : chunk / 8;
        pipe_.InitBuffer(inQueue_, 2, bytes);
        pipe_.InitBuffer(lpBuf_, bytes);
        pipe_.InitBuffer(auxBuf_, bytes);
        pipe_.InitBuffer(scoreBuf_, bytes);
        pipe_.InitBuffer(indexBuf_, bytes);
        pipe_.InitBuffer(hashBuf_, bytes);
        pipe_.InitBuffer(scratchBuf_, bytes);
        pipe_.InitBuffer(divisorBuf_, bytes);
        pipe_.InitBuffer(maskBuf_, maskBytes);
        pipe_.InitBuffer(workBuf_, bytes);
        pipe_.InitBuffer(scalarBuf_, kScalarLanes * sizeof(float));
        pipe_.InitBuffer(outBuf_, 32);
    }

    __aicore__ inline void Process()
    {
        for (uint32_t row = GetBlockIdx(); row < rows_; row += GetBlockNum()) {
            rowOffset_ = static_cast<uint64_t>(row) * vocab_;
            float temperature = temperatureGm_.GetValue(row);
            int64_t token = temperature > 0.0f ? SampleRow(row, temperature) : Argmax();
            Store(row, token);
        }
    }

private:
    // ---------------------------------------------------------------- loading
    // Copies chunk c of the row into `dst`, padding past the vocabulary with -inf; returns its start.
    __aicore__ inline uint32_t Load(uint32_t c, const LocalTensor<float> &dst)
    {
        uint32_t start = c * chunk_;
        uint32_t valid = vocab_ - start < chunk_ ? vocab_ - start : chunk_;
        LocalTensor<float> x = inQueue_.AllocTensor<float>();
        if (valid < chunk_) {
            Duplicate(x, BitsToFloat(0xFF800000u), chunk_);
            Wait<HardEvent::V_MTE2>();
        }
        DataCopyExtParams copy{1, static_cast<uint32_t>(valid * sizeof(float)), 0, 0, 0};
        DataCopyPad(x, logitsGm_[rowOffset_ + start], copy, DataCopyPadExtParams<float>{false, 0, 0, 0.0f});
        inQueue_.EnQue(x);
        x = inQueue_.DeQue<float>();
        DataCopy(dst, x, chunk_);
        PipeBarrier<PIPE_V>();
        inQueue_.FreeTensor(x);
        return start;
    }

    // lp <- logits[c] / T (then - m - ln s when `normalise`).
    __aicore__ inline uint32_t LoadScaled(uint32_t c, bool normalise)
    {
        LocalTensor<float> lp = lpBuf_.Get<float>();
        uint32_t start = Load(c, lp);
        Div(lp, lp, divisorBuf_.Get<float>(), chunk_);
        PipeBarrier<PIPE_V>();
        if (normalise) {
            Adds(lp, lp, -max_, chunk_);
            PipeBarrier<PIPE_V>();
            Adds(lp, lp, -logSum_, chunk_);
            PipeBarrier<PIPE_V>();
        }
        return start;
    }

    // ---------------------------------------------------------------- small helpers
    __aicore__ inline float ReduceMaxOf(const LocalTensor<float> &src)
    {
        LocalTensor<float> result = scalarBuf_.Get<float>();
        ReduceMax(result, src, workBuf_.Get<float>(), chunk_, false);
        Wait<HardEvent::V_S>();
        return result.GetValue(0);
    }

    __aicore__ inline float ReduceSumOf(const LocalTensor<float> &src)
    {
        LocalTensor<float> result = scalarBuf_.Get<float>();
        ReduceSum(result, src, workBuf_.Get<float>(), chunk_);
        Wait<HardEvent::V_S>();
        return result.GetValue(0);
    }

    // exp or ln of one scalar, on the vector unit (the scalar unit has no transcendental functions).
    __aicore__ inline float ScalarMath(float value, bool natural_log)
    {
        LocalTensor<float> lanes = scalarBuf_.Get<float>();
        Wait<HardEvent::S_V>();
        Duplicate(lanes, value, kScalarLanes);
        PipeBarrier<PIPE_V>();
        if (natural_log) {
            Ln(lanes, lanes, kScalarLanes);
        } else {
            Exp(lanes, lanes, kScalarLanes);
        }
        Wait<HardEvent::V_S>();
        return lanes.GetValue(0);
    }

    // Index (within the chunk) of the first element of `src` equal to `value`.
    __aicore__ inline uint32_t FirstIndexOf(const LocalTensor<float> &src, float value)
    {
        LocalTensor<uint8_t> mask = maskBuf_.Get<uint8_t>();
        LocalTensor<float> negIndex = indexBuf_.Get<float>();
        Wait<HardEvent::S_V>();
        CompareScalar(mask, src, value, CMPMODE::EQ, chunk_);
        ArithProgression<float>(negIndex, 0.0f, -1.0f, chunk_);
        PipeBarrier<PIPE_V>();
        Select(negIndex, mask, negIndex, -static_cast<float>(chunk_), SELMODE::VSEL_TENSOR_SCALAR_MODE, chunk_);
        PipeBarrier<PIPE_V>();
        return static_cast<uint32_t>(-ReduceMaxOf(negIndex));
    }

    // Count and probability mass of the row's tokens with lp > t (or >= t).
    __aicore__ inline CountMass Above(float t, bool inclusive)
    {
        CountMass total{0.0f, 0.0f};
        LocalTensor<float> lp = lpBuf_.Get<float>();
        LocalTensor<float> aux = auxBuf_.Get<float>();
        LocalTensor<float> ones = scoreBuf_.Get<float>();
        LocalTensor<uint8_t> mask = maskBuf_.Get<uint8_t>();
        for (uint32_t c = 0; c < chunks_; ++c) {
            LoadScaled(c, true);
            Wait<HardEvent::S_V>();
            CompareScalar(mask, lp, t, inclusive ? CMPMODE::GE : CMPMODE::GT, chunk_);
            Duplicate(ones, 1.0f, chunk_);
            Exp(aux, lp, chunk_);
            PipeBarrier<PIPE_V>();
            Select(ones, mask, ones, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, chunk_);
            Select(aux, mask, aux, 0.0f, SELMODE::VSEL_TENSOR_SCALAR_MODE, chunk_);
            PipeBarrier<PIPE_V>();
            total.count += ReduceSumOf(ones);
            total.mass += ReduceSumOf(aux);
        }
        return total;
    }

    // ---------------------------------------------------------------- noise
    // dst = a ^ b on 32-bit lanes, as 16-bit lane ops: (a | b) & ~(a & b).
    __aicore__ inline void Xor32(const LocalTensor<uint32_t> &dst, const LocalTensor<uint32_t> &a,
                                 const LocalTensor<uint32_t> &b)
    {
        LocalTensor<uint16_t> d = dst.ReinterpretCast<uint16_t>();
        LocalTensor<uint16_t> x = a.ReinterpretCast<uint16_t>();
        LocalTensor<uint16_t> y = b.ReinterpretCast<uint16_t>();
        LocalTensor<uint16_t> both = workBuf_.Get<uint16_t>();
        int32_t lanes = static_cast<int32_t>(chunk_ * 2);
        And(both, x, y, lanes);
        PipeBarrier<PIPE_V>();
        Not(both, both, lanes);
        Or(d, x, y, lanes);
        PipeBarrier<PIPE_V>();
        And(d, d, both, lanes);
        PipeBarrier<PIPE_V>();
    }

    // x <- mix32(x) on every lane (multiplications wrap modulo 2^32).
    __aicore__ inline void Mix32Lanes(const LocalTensor<uint32_t> &x)
    {
        LocalTensor<uint32_t> shifted = scratchBuf_.Get<uint32_t>();
        LocalTensor<int32_t> xs = x.ReinterpretCast<int32_t>();
        const uint32_t shifts[3] = {16, 15, 16};
        const int32_t factors[2] = {static_cast<int32_t>(0x7FEB352Du), static_cast<int32_t>(0x846CA68Bu)};
        for (int step = 0; step < 3; ++step) {
            ShiftRight(shifted, x, shifts[step], static_cast<int32_t>(chunk_));
            PipeBarrier<PIPE_V>();
            Xor32(x, x, shifted);
            if (step < 2) {
                Muls(xs, xs, factors[step], static_cast<int32_t>(chunk_));
                PipeBarrier<PIPE_V>();
            }
        }
    }

    // aux <- Gumbel noise -ln(-ln(u)) of the chunk's tokens [start, start + chunk).
    __aicore__ inline void Noise(uint32_t start, uint32_t rowKey)
    {
        LocalTensor<float> aux = auxBuf_.Get<float>();
        LocalTensor<uint32_t> hash = hashBuf_.Get<uint32_t>();
        LocalTensor<uint32_t> key = scratchBuf_.Get<uint32_t>();
        Wait<HardEvent::S_V>();
        ArithProgression<float>(aux, static_cast<float>(start), 1.0f, chunk_);
        PipeBarrier<PIPE_V>();
        Cast(hash.ReinterpretCast<int32_t>(), aux, RoundMode::CAST_RINT, chunk_);
        PipeBarrier<PIPE_V>();
        Mix32Lanes(hash);
        Duplicate(key.ReinterpretCast<int32_t>(), static_cast<int32_t>(rowKey), chunk_);
        PipeBarrier<PIPE_V>();
        Xor32(hash, hash, key);
        Mix32Lanes(hash);
        ShiftRight(hash, hash, 9u, static_cast<int32_t>(chunk_));
        PipeBarrier<PIPE_V>();
        Cast(aux, hash.ReinterpretCast<int32_t>(), RoundMode::CAST_NONE, chunk_);
        PipeBarrier<PIPE_V>();
        Adds(aux, aux, 0.5f, chunk_);
        PipeBarrier<PIPE_V>();
        Muls(aux, aux, kTwoPowMinus23, chunk_);
        PipeBarrier<PIPE_V>();
        Ln(aux, aux, chunk_);
        PipeBarrier<PIPE_V>();
        Muls(aux, aux, -1.0f, chunk_);
        PipeBarrier<PIPE_V>();
        Ln(aux, aux, chunk_);
        PipeBarrier<PIPE_V>();
        Muls(aux, aux, -1.0f, chunk_);
        PipeBarrier<PIPE_V>();
    }

    // ---------------------------------------------------------------- rows
    __aicore__ inline int64_t Argmax()
    {
        LocalTensor<float> x = lpBuf_.Get<float>();
        float best = 0.0f;
        int64_t bestIndex = -1;
        for (uint32_t c = 0; c < chunks_; ++c) {
            uint32_t start = Load(c, x);
            float tileMax = ReduceMaxOf(x);
            if (bestIndex < 0 || tileMax > best) {
                best = tileMax;
                bestIndex = start + FirstIndexOf(x, tileMax);
            }
        }
        return bestIndex;
    }

    __aicore__ inline int64_t SampleRow(uint32_t row, float temperature)
    {
        Duplicate(divisorBuf_.Get<float>(), temperature, chunk_);
        PipeBarrier<PIPE_V>();
        LocalTensor<float> lp = lpBuf_.Get<float>();
        LocalTensor<float> aux = auxBuf_.Get<float>();

        max_ = BitsToFloat(0xFF800000u);
        for (uint32_t c = 0; c < chunks_; ++c) {
            LoadScaled(c, false);
            float tileMax = ReduceMaxOf(lp);
            max_ = tileMax > max_ ? tileMax : max_;
        }
        float sum = 0.0f;
        for (uint32_t c = 0; c < chunks_; ++c) {
            LoadScaled(c, false);
            Wait<HardEvent::S_V>();
            Adds(aux, lp, -max_, chunk_);
            PipeBarrier<PIPE_V>();
            Exp(aux, aux, chunk_);
            PipeBarrier<PIPE_V>();
            sum += ReduceSumOf(aux);
        }
        logSum_ = ScalarMath(sum, true);

        // Cut: allowed = key > cutKey, or key == cutKey among the first cutTies such tokens (id order).
        uint32_t cutKey = kNegInfKey;
        float cutTies = 0.0f;
        float kept = -1.0f;  // Z, the probability mass of the top-k set (computed when top-p needs it)
        int32_t k = topKGm_.GetValue(row);
        if (k > 0 && static_cast<uint32_t>(k) < vocab_ && Above(KeyValue(kNegInfKey + 1), true).count >= k) {
            uint32_t lo = kNegInfKey + 1;
            uint32_t hi = kPosInfKey;
            while (lo < hi) {
                uint32_t mid = lo + (hi - lo + 1) / 2;
                if (Above(KeyValue(mid), true).count >= static_cast<float>(k)) {
                    lo = mid;
                } else {
                    hi = mid - 1;
                }
            }
            CountMass above = Above(KeyValue(lo), false);
            cutKey = lo;
            cutTies = static_cast<float>(k) - above.count;
            kept = above.mass + cutTies * ScalarMath(KeyValue(lo), false);
        }
        float topP = topPGm_.GetValue(row);
        if (topP < 1.0f) {
            if (kept < 0.0f) {
                kept = Above(KeyValue(kNegInfKey), false).mass;
            }
            float target = topP * kept;
            uint32_t lo = cutKey;
            uint32_t hi = kPosInfKey;
            while (lo < hi) {
                uint32_t mid = lo + (hi - lo) / 2;
                if (Above(KeyValue(mid), false).mass < target) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            CountMass above = Above(KeyValue(lo), false);
            float available = lo == cutKey && cutKey != kNegInfKey ? cutTies
                                                                 : Above(KeyValue(lo), true).count - above.count;
            float each = ScalarMath(KeyValue(lo), false);
            float ties = 0.0f;
            while (ties < available && above.mass + ties * each < target) {
                ties += 1.0f;
            }
            cutKey = lo;
            cutTies = ties;
        }
        float minP = minPGm_.GetValue(row);
        float minProb = minP * ScalarMath(-logSum_, false);
        uint32_t key = RowKey(seedsGm_.GetValue(row), offsetsGm_.GetValue(row));
        return DrawAllowed(key, cutKey, cutTies, minP > 0.0f, minProb);
    }

    // argmax over allowed tokens of lp + noise (first maximum).
    __aicore__ inline int64_t DrawAllowed(uint32_t rowKey, uint32_t cutKey, float cutTies, bool useMinP,
                                          float minProb)
    {
        LocalTensor<float> lp = lpBuf_.Get<float>();
        LocalTensor<float> aux = auxBuf_.Get<float>();
        LocalTensor<float> score = scoreBuf_.Get<float>();
        LocalTensor<uint8_t> mask = maskBuf_.Get<uint8_t>();
        const float negInf = BitsToFloat(0xFF800000u);
        const float cutValue = KeyValue(cutKey);
        float tiesLeft = cutTies;
        float best = negInf;
        int64_t bestIndex = -1;
        for (uint32_t c = 0; c < chunks_; ++c) {
            uint32_t start = LoadScaled(c, true);
            Noise(start, rowKey);
            Add(aux, lp, aux, chunk_);  // aux <- lp + noise
            PipeBarrier<PIPE_V>();
            Wait<HardEvent::S_V>();
            CompareScalar(mask, lp, cutValue, CMPMODE::GT, chunk_);
            PipeBarrier<PIPE_V>();
            Select(score, mask, aux, negInf, SELMODE::VSEL_TENSOR_SCALAR_MODE, chunk_);
            PipeBarrier<PIPE_V>();
            if (tiesLeft > 0.0f) {
                Wait<HardEvent::V_S>();
                for (uint32_t i = 0; i < chunk_ && tiesLeft > 0.0f; ++i) {
                    if (lp.GetValue(i) == cutValue) {
                        score.SetValue(i, aux.GetValue(i));
                        tiesLeft -= 1.0f;
                    }
                }
                Wait<HardEvent::S_V>();
            }
            if (useMinP) {
                Exp(aux, lp, chunk_);
                PipeBarrier<PIPE_V>();
                CompareScalar(mask, aux, minProb, CMPMODE::GE, chunk_);
                PipeBarrier<PIPE_V>();
                Select(score, mask, score, negInf, SELMODE::VSEL_TENSOR_SCALAR_MODE, chunk_);
                PipeBarrier<PIPE_V>();
            }
            float tileMax = ReduceMaxOf(score);
            if (bestIndex < 0 || tileMax > best) {
                best = tileMax;
                bestIndex = start + FirstIndexOf(score, tileMax);
            }
        }
        return bestIndex;
    }

    __aicore__ inline void Store(uint32_t row, int64_t token)
    {
        LocalTensor<int64_t> value = outBuf_.Get<int64_t>();
        value.SetValue(0, token);
        Wait<HardEvent::S_MTE3>();
        DataCopyExtParams copy{1, static_cast<uint32_t>(sizeof(int64_t)), 0, 0, 0};
        DataCopyPad(outGm_[row], value, copy);
        Wait<HardEvent::MTE3_S>();
    }

    TPipe pipe_;
    TQue<QuePosition::VECIN, 2> inQueue_;
    TBuf<TPosition::VECCALC> lpBuf_, auxBuf_, scoreBuf_, indexBuf_, hashBuf_, scratchBuf_, divisorBuf_, maskBuf_,
        workBuf_, scalarBuf_, outBuf_;
    GlobalTensor<float> logitsGm_, temperatureGm_, topPGm_, minPGm_;
    GlobalTensor<int32_t> topKGm_;
    GlobalTensor<int64_t> seedsGm_, offsetsGm_, outGm_;
    uint32_t rows_ = 0, vocab_ = 0, chunk_ = 0, chunks_ = 0;
    uint64_t rowOffset_ = 0;
    float max_ = 0.0f, logSum_ = 0.0f;
};

}  // namespace

extern "C" __global__ __aicore__ void deepinfer_sample_kernel(GM_ADDR logits, GM_ADDR temperature, GM_ADDR topK,
                                                              GM_ADDR topP, GM_ADDR minP, GM_ADDR seeds,
                                                              GM_ADDR offsets, GM_ADDR out, uint32_t rows,
                                                              uint32_t vocab, uint32_t chunk, uint32_t chunks)
{
    SampleKernel kernel;
    kernel.Init(logits, temperature, topK, topP, minP, seeds, offsets, out, rows, vocab, chunk, chunks);
    kernel.Process();
}

namespace deepinfer_ascend {

void LaunchSampleKernel(void *stream, uint32_t blockDim, void *logits, void *temperature, void *topK, void *topP,
                        void *minP, void *seeds, void *offsets, void *out, uint32_t rows, uint32_t vocab,
                        uint32_t chunk, uint32_t chunks)
{
    deepinfer_sample_kernel<<<blockDim, nullptr, stream>>>(
        static_cast<uint8_t *>(logits), static_cast<uint8_t *>(temperature), static_cast<uint8_t *>(topK),
        static_cast<uint8_t *>(topP), static_cast<uint8_t *>(minP), static_cast<uint8_t *>(seeds),
        static_cast<uint8_t *>(offsets), static_cast<uint8_t *>(out), rows, vocab, chunk, chunks);
}

}  // namespace deepinfer_ascend
