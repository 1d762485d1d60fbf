/* cuda_copy.c — simgpu's memcpy and memset, synchronous and stream-ordered. */
#include "cuda_internal.h"

/* === memcpy / memset ===
 * Synchronous copies wait for the context's queued work, as copies on the legacy stream
 * do; asynchronous ones are done at once (simulated kernels never touch data). */

static int device_range_ok(CUdeviceptr p, size_t n)
{
    struct alloc a;
    return alloc_find(p, n ? n : 1, &a) && a.kind != A_HOST;
}

CUresult copy(void *dst, const void *src, size_t n, int sync)
{
    REQUIRE_CTX(c);
    if (n && (!dst || !src))
        return CUDA_ERROR_INVALID_VALUE;
    if (sync)
        simgpu_sleep_until(__atomic_load_n(&c->last_end, __ATOMIC_ACQUIRE));
    memmove(dst, src, n);
    return CUDA_SUCCESS;
}

#define DPTR(p) ((void *)(uintptr_t)(p))
#define CHECK_DEV(p, n)                     \
    REQUIRE_INIT();                         \
    if (!device_range_ok((p), (n)))         \
        return CUDA_ERROR_INVALID_VALUE

SIMGPU_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    CHECK_DEV(dst, n);
    return copy(DPTR(dst), src, n, 1);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    CHECK_DEV(src, n);
    return copy(dst, DPTR(src), n, 1);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    CHECK_DEV(dst, n);
    CHECK_DEV(src, n);
    return copy(DPTR(dst), DPTR(src), n, 1);
}
SIMGPU_EXPORT CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    return copy(DPTR(dst), DPTR(src), n, 1);   /* unified addressing: either side may be host */
}

static CUresult copy_async(void *dst, const void *src, size_t n, CUstream h)
{
    REQUIRE_INIT();
    CUresult err;
    if (!resolve_stream(h, &err))
        return err;
    return copy(dst, src, n, 0);
}

SIMGPU_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream h)
{
    CHECK_DEV(dst, n);
    return copy_async(DPTR(dst), src, n, h);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream h)
{
    CHECK_DEV(src, n);
    return copy_async(dst, DPTR(src), n, h);
}
SIMGPU_EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    CHECK_DEV(dst, n);
    CHECK_DEV(src, n);
    return copy_async(DPTR(dst), DPTR(src), n, h);
}
SIMGPU_EXPORT CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h)
{
    return copy_async(DPTR(dst), DPTR(src), n, h);
}

SIMGPU_EXPORT CUresult cuMemcpyHtoD_v2_ptds(CUdeviceptr d, const void *s, size_t n) { PER_THREAD(cuMemcpyHtoD_v2(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoH_v2_ptds(void *d, CUdeviceptr s, size_t n) { PER_THREAD(cuMemcpyDtoH_v2(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoD_v2_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { PER_THREAD(cuMemcpyDtoD_v2(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpy_ptds(CUdeviceptr d, CUdeviceptr s, size_t n) { PER_THREAD(cuMemcpy(d, s, n)); }
SIMGPU_EXPORT CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr d, const void *s, size_t n, CUstream h) { PER_THREAD(cuMemcpyHtoDAsync_v2(d, s, n, h)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoHAsync_v2_ptsz(void *d, CUdeviceptr s, size_t n, CUstream h) { PER_THREAD(cuMemcpyDtoHAsync_v2(d, s, n, h)); }
SIMGPU_EXPORT CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { PER_THREAD(cuMemcpyDtoDAsync_v2(d, s, n, h)); }
SIMGPU_EXPORT CUresult cuMemcpyAsync_ptsz(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream h) { PER_THREAD(cuMemcpyAsync(d, s, n, h)); }

/* One side of a 2D copy (cuda.h, CUDA_MEMCPY2D): HOST is host memory at host; DEVICE device
 * memory at dev; UNIFIED any address of the unified space at dev; ARRAY the array's level 0
 * (its rows, no pitch), where "XInBytes must be evenly divisible by the array element size".
 * The first row starts at base + y * pitch + x; "If specified, srcPitch must be greater
 * than or equal to WidthInBytes + srcXInBytes" (likewise dst), and no pitch may exceed
 * CU_DEVICE_ATTRIBUTE_MAX_PITCH.  Fills *start and *row (the pitch that applies). */
static CUresult copy2d_side(int type, const void *host, CUdeviceptr dev, CUarray array, size_t pitch, size_t x,
                            size_t y, size_t width, size_t height, unsigned char **start, size_t *row)
{
    uint64_t base, first, extent;
    switch (type) {
    case CU_MEMORYTYPE_ARRAY:
        if (!handle_ok(array, K_ARRAY))
            return CUDA_ERROR_INVALID_HANDLE;
        if (!array->elem || x % array->elem || x > array->row_bytes || width > array->row_bytes - x ||
            y > array->rows || height > array->rows - y)
            return CUDA_ERROR_INVALID_VALUE;
        *start = (unsigned char *)array->data + y * array->row_bytes + x;
        *row = (size_t)array->row_bytes;
        return CUDA_SUCCESS;
    case CU_MEMORYTYPE_HOST:
        base = (uint64_t)(uintptr_t)host;
        break;
    case CU_MEMORYTYPE_DEVICE:
    case CU_MEMORYTYPE_UNIFIED:
        base = dev;
        break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!base || pitch > 2147483647u || ((pitch || height > 1) && (x + width < x || pitch < x + width)))
        return CUDA_ERROR_INVALID_VALUE;
    if (__builtin_mul_overflow((uint64_t)y, pitch, &first) || __builtin_add_overflow(first, x, &first) ||
        __builtin_mul_overflow((uint64_t)(height - 1), pitch, &extent) || __builtin_add_overflow(extent, width, &extent) ||
        __builtin_add_overflow(base, first, &first))
        return CUDA_ERROR_INVALID_VALUE;
    struct alloc a;
    if (type == CU_MEMORYTYPE_DEVICE && !device_range_ok(first, extent))
        return CUDA_ERROR_INVALID_VALUE;   /* not device memory, or past its end */
    if (type == CU_MEMORYTYPE_UNIFIED && alloc_find(first, 1, &a) && !alloc_find(first, extent, NULL))
        return CUDA_ERROR_INVALID_VALUE;   /* memory the driver knows, past its end */
    *start = (unsigned char *)(uintptr_t)first;
    *row = pitch;
    return CUDA_SUCCESS;
}

/* cuda.h, cuMemcpy2DAsync (_v2, CUDA 3.2): "Perform a 2D memory copy according to the
 * parameters specified in pCopy", WidthInBytes by Height rows, on hStream.  Done when
 * called, as simgpu's other asynchronous copies. */
SIMGPU_EXPORT CUresult cuMemcpy2DAsync_v2(const CUDA_MEMCPY2D *p, CUstream h)
{
    REQUIRE_CTX(c);
    (void)c;
    CUresult err;
    if (!resolve_stream(h, &err))
        return err;
    if (!p)
        return CUDA_ERROR_INVALID_VALUE;
    if (!p->WidthInBytes || !p->Height)
        return CUDA_SUCCESS;
    unsigned char *src, *dst;
    size_t spitch, dpitch;
    if ((err = copy2d_side(p->srcMemoryType, p->srcHost, p->srcDevice, p->srcArray, p->srcPitch, p->srcXInBytes,
                           p->srcY, p->WidthInBytes, p->Height, &src, &spitch)) != CUDA_SUCCESS ||
        (err = copy2d_side(p->dstMemoryType, p->dstHost, p->dstDevice, p->dstArray, p->dstPitch, p->dstXInBytes,
                           p->dstY, p->WidthInBytes, p->Height, &dst, &dpitch)) != CUDA_SUCCESS)
        return err;
    for (size_t r = 0; r < p->Height; r++)
        memmove(dst + r * dpitch, src + r * spitch, p->WidthInBytes);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemcpy2DAsync_v2_ptsz(const CUDA_MEMCPY2D *p, CUstream h) { PER_THREAD(cuMemcpy2DAsync_v2(p, h)); }

static CUresult fill(CUdeviceptr dst, uint32_t value, unsigned width, size_t count, int sync, CUstream h)
{
    REQUIRE_CTX(c);
    CUresult err;
    if (!sync && !resolve_stream(h, &err))
        return err;
    if (count > SIZE_MAX / width || !device_range_ok(dst, count * width))
        return CUDA_ERROR_INVALID_VALUE;
    if (sync)
        simgpu_sleep_until(__atomic_load_n(&c->last_end, __ATOMIC_ACQUIRE));
    unsigned char *p = DPTR(dst);
    if (width == 1) {
        memset(p, (int)value, count);
    } else if (width == 2) {
        uint16_t v = (uint16_t)value;
        for (size_t i = 0; i < count; i++)
            memcpy(p + 2 * i, &v, 2);
    } else {
        for (size_t i = 0; i < count; i++)
            memcpy(p + 4 * i, &value, 4);
    }
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return fill(d, v, 1, n, 1, NULL); }
SIMGPU_EXPORT CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { return fill(d, v, 2, n, 1, NULL); }
SIMGPU_EXPORT CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned int v, size_t n) { return fill(d, v, 4, n, 1, NULL); }
SIMGPU_EXPORT CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream h) { return fill(d, v, 1, n, 0, h); }
SIMGPU_EXPORT CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream h) { return fill(d, v, 2, n, 0, h); }
SIMGPU_EXPORT CUresult cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream h) { return fill(d, v, 4, n, 0, h); }
SIMGPU_EXPORT CUresult cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n) { PER_THREAD(cuMemsetD8_v2(d, v, n)); }
SIMGPU_EXPORT CUresult cuMemsetD16_v2_ptds(CUdeviceptr d, unsigned short v, size_t n) { PER_THREAD(cuMemsetD16_v2(d, v, n)); }
SIMGPU_EXPORT CUresult cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned int v, size_t n) { PER_THREAD(cuMemsetD32_v2(d, v, n)); }
SIMGPU_EXPORT CUresult cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream h) { PER_THREAD(cuMemsetD8Async(d, v, n, h)); }
SIMGPU_EXPORT CUresult cuMemsetD16Async_ptsz(CUdeviceptr d, unsigned short v, size_t n, CUstream h) { PER_THREAD(cuMemsetD16Async(d, v, n, h)); }
SIMGPU_EXPORT CUresult cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned int v, size_t n, CUstream h) { PER_THREAD(cuMemsetD32Async(d, v, n, h)); }
