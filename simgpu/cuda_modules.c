/* cuda_modules.c — simgpu's modules, libraries and functions, function attributes and
 * occupancy, the linker (cuLink*), kernel launch and tensor maps.
 */
#include "cuda_internal.h"

/* === modules, libraries, functions ===
 * A module holds the kernels its image names (simgpu/image.h): PTX, cubins, fatbins,
 * objects, libraries and what cuLinkComplete produced.  A stand-in image (anything else,
 * e.g. the string "image") holds every name: the simulation convention of simgpu's tests.
 * What a kernel does: nothing to memory (simgpu runs no device code), and it takes
 * simulated time on the device's timeline: a kernel named sim_<N>us, or whose mangled
 * name's identifier is sim_<N>us (numba's _ZN...9sim_300usB2v1..., a Triton kernel
 * def sim_300us), runs N microseconds per wave of blocks (a wave is as many blocks as the
 * device has SMs); any other kernel SIMGPU_DEFAULT_KERNEL_US per wave. */

static int device_cc(void) { return simgpu_profile()->cc_major * 10 + simgpu_profile()->cc_minor; }

/* N if `name` is sim_<N>us, or holds sim_<N>us as one length-prefixed identifier of an
 * Itanium-mangled name (…<len>sim_<N>us…); else SIMGPU_DEFAULT_KERNEL_US. */
static uint64_t sim_us_of(const char *name)
{
    unsigned long long us;
    int end = 0;
    if (sscanf(name, "sim_%lluus%n", &us, &end) == 1 && end && !name[end])
        return us;   /* sim_0us: no time at all */
    for (const char *p = strstr(name, "sim_"); p; p = strstr(p + 1, "sim_")) {
        const char *d = p;
        while (d > name && d[-1] >= '0' && d[-1] <= '9')
            d--;
        if (d == p || sscanf(p, "sim_%lluus%n", &us, &end) != 1 || !end)
            continue;
        if (strtoul(d, NULL, 10) == (unsigned long)end)   /* the identifier is exactly sim_<N>us */
            return us;
    }
    return SIMGPU_DEFAULT_KERNEL_US;
}

/* The module's function `name`: NULL with *err set when the image has no such kernel. */
static struct vgpu_function *function_get(struct vgpu_module *m, const char *name, CUresult *err)
{
    for (struct vgpu_function *f = m->functions; f; f = f->next)
        if (strcmp(f->name, name) == 0)
            return f;
    const struct simgpu_kernel *k = NULL;
    if (m->image.names_known && !(k = simgpu_image_find(&m->image, name))) {
        *err = CUDA_ERROR_NOT_FOUND;
        return NULL;
    }
    struct vgpu_function *f = handle_new(K_FUNCTION);
    if (!f || !(f->name = strdup(name))) {
        if (f)
            handle_free(f);
        *err = CUDA_ERROR_OUT_OF_MEMORY;
        return NULL;
    }
    if (k)
        f->info = *k;
    f->info.name = NULL;
    f->carveout = -1;
    f->module = m;
    f->us_per_wave = sim_us_of(name);
    f->next = m->functions;
    m->functions = f;
    return f;
}

/* JIT options (cuModuleLoadDataEx, cuLink*, cuLibraryLoadData): simgpu compiles nothing,
 * so it honours the log buffers (errors say why an image was refused; the info log, with
 * CU_JIT_LOG_VERBOSE, what was loaded), writes back the bytes logged and a wall time of 0,
 * and accepts every other known option. */
struct jit_log {
    char *info, *error;
    size_t info_cap, error_cap, info_len, error_len;
    void **values;
    int info_size_at, error_size_at, wall_at, verbose;
};

static CUresult jit_options(unsigned n, const CUjit_option *options, void **values, struct jit_log *log)
{
    memset(log, 0, sizeof *log);
    log->info_size_at = log->error_size_at = log->wall_at = -1;
    if (n && (!options || !values))
        return CUDA_ERROR_INVALID_VALUE;
    log->values = values;
    for (unsigned i = 0; i < n; i++) {
        uintptr_t v = (uintptr_t)values[i];
        switch (options[i]) {
        case CU_JIT_INFO_LOG_BUFFER: log->info = (char *)values[i]; break;
        case CU_JIT_ERROR_LOG_BUFFER: log->error = (char *)values[i]; break;
        case CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES: log->info_cap = (unsigned)v, log->info_size_at = (int)i; break;
        case CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES: log->error_cap = (unsigned)v, log->error_size_at = (int)i; break;
        case CU_JIT_WALL_TIME: log->wall_at = (int)i; break;
        case CU_JIT_LOG_VERBOSE: log->verbose = v != 0; break;
        default:
            if (options[i] < 0 || options[i] >= CU_JIT_NUM_OPTIONS)
                return CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (!log->info)
        log->info_cap = 0;
    if (!log->error)
        log->error_cap = 0;
    return CUDA_SUCCESS;
}

static void jit_append(char *buf, size_t cap, size_t *len, const char *line)
{
    if (!buf || *len + 1 >= cap)
        return;
    int w = snprintf(buf + *len, cap - *len, "%s%s", *len ? "\n" : "", line);
    *len = w < 0 ? *len : *len + (size_t)w >= cap ? cap - 1 : *len + (size_t)w;
}

/* Write back what was logged (bytes including the NUL) and the wall time. */
static void jit_done(struct jit_log *log)
{
    if (log->info_size_at >= 0)
        log->values[log->info_size_at] = (void *)(uintptr_t)(log->info_len ? log->info_len + 1 : 0);
    if (log->error_size_at >= 0)
        log->values[log->error_size_at] = (void *)(uintptr_t)(log->error_len ? log->error_len + 1 : 0);
    if (log->wall_at >= 0) {
        float ms = 0;
        memcpy(&log->values[log->wall_at], &ms, sizeof ms);
    }
}

/* Read an image for a module or a link input, logging why it is refused. */
static CUresult read_image(const void *data, size_t size, int kind, const char *name, struct jit_log *log,
                           struct simgpu_image *img)
{
    char why[256];
    CUresult r = simgpu_image_read(data, size, kind, device_cc(), img, why, sizeof why);
    if (r != CUDA_SUCCESS && log) {
        char line[400];
        snprintf(line, sizeof line, "error   : %s%s%s", name ? name : "", name ? ": " : "", why[0] ? why : "bad image");
        jit_append(log->error, log->error_cap, &log->error_len, line);
    } else if (r == CUDA_SUCCESS && log && log->verbose) {
        char line[400];
        snprintf(line, sizeof line, "info    : simgpu: %s%s%zu kernel(s)%s, not compiled (simulated device)",
                 name ? name : "", name ? ": " : "", img->count, img->names_known ? "" : " (stand-in image)");
        jit_append(log->info, log->info_cap, &log->info_len, line);
    }
    return r;
}

/* A module's variables (cuModuleGetGlobal, cuLibraryGetGlobal) live in device memory of
 * their own from load to unload: one block, each variable at its section's alignment,
 * holding its initial bytes (zeros for .nv.global).  simgpu counts no device memory for a
 * module's code or data (a model: the driver does not document what loading costs). */
static CUresult module_globals(struct vgpu_module *m)
{
    const struct simgpu_image *img = &m->image;
    if (!img->nglobals)
        return CUDA_SUCCESS;
    uint64_t *at = malloc(img->nglobals * sizeof *at), size = 0;
    if (!at)
        return CUDA_ERROR_OUT_OF_MEMORY;
    for (size_t i = 0; i < img->nglobals; i++) {
        at[i] = size = round_up(size, img->globals[i].align);
        size += img->globals[i].size;
    }
    size = size ? size : 1;
    unsigned char *p = map_lazy(size);
    struct vgpu_ctx *c = current_ctx();
    if (!p || alloc_insert((struct alloc){(uint64_t)(uintptr_t)p, size, c ? c->dev : 0, A_MODULE, 0, NULL, NULL,
                                          NULL, 0, 0, 0})) {
        if (p)
            munmap(p, size);
        free(at);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (size_t i = 0; i < img->nglobals; i++)
        if (img->globals[i].init)
            memcpy(p + at[i], img->globals[i].init, img->globals[i].size);
    m->globals = (uint64_t)(uintptr_t)p;
    m->global_at = at;
    return CUDA_SUCCESS;
}

static CUresult module_new(CUmodule *out, const void *data, size_t size, struct jit_log *log)
{
    REQUIRE_INIT();
    if (!out || !data)
        return CUDA_ERROR_INVALID_VALUE;
    struct simgpu_image img;
    CUresult r = read_image(data, size, IMG_ANY, NULL, log, &img);
    if (log)
        jit_done(log);
    if (r != CUDA_SUCCESS)
        return r;
    struct vgpu_module *m = handle_new(K_MODULE);
    if (!m) {
        simgpu_image_free(&img);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    m->image = img;
    if ((r = module_globals(m)) != CUDA_SUCCESS) {
        simgpu_image_free(&m->image);
        handle_free(m);
        return r;
    }
    *out = m;
    return CUDA_SUCCESS;
}

/* A whole file, NUL-terminated (PTX is text); NULL with *err set. */
static void *read_file(const char *path, size_t *size, CUresult *err)
{
    FILE *f = path ? fopen(path, "rbe") : NULL;
    if (!f) {
        *err = path ? CUDA_ERROR_FILE_NOT_FOUND : CUDA_ERROR_INVALID_VALUE;
        return NULL;
    }
    char *d = NULL;
    size_t len = 0, cap = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            char *n = realloc(d, cap = (cap ? cap * 2 : 65536));
            if (!n)
                break;
            d = n;
        }
        size_t got = fread(d + len, 1, cap - len - 1, f);
        len += got;
        if (!got)
            break;
    }
    int bad = ferror(f) || !d;
    fclose(f);
    if (bad) {
        free(d);
        *err = CUDA_ERROR_FILE_NOT_FOUND;
        return NULL;
    }
    d[len] = 0;
    *size = len;
    return d;
}

SIMGPU_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    return module_new(module, image, 0, NULL);
}

SIMGPU_EXPORT CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                          CUjit_option *options, void **optionValues)
{
    struct jit_log log;
    CUresult r = jit_options(numOptions, options, optionValues, &log);
    return r != CUDA_SUCCESS ? r : module_new(module, image, 0, &log);
}

SIMGPU_EXPORT CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin)
{
    return cuModuleLoadData(module, fatCubin);
}

SIMGPU_EXPORT CUresult cuModuleLoad(CUmodule *module, const char *fname)
{
    REQUIRE_INIT();
    if (!fname)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult r;
    size_t size;
    void *data = read_file(fname, &size, &r);
    if (!data)
        return r;
    r = module_new(module, data, size, NULL);
    free(data);
    return r;
}

static void module_free(struct vgpu_module *m)
{
    for (struct vgpu_function *f = m->functions, *next; f; f = next) {
        next = f->next;
        free(f->name);
        handle_free(f);
    }
    struct alloc a;
    if (m->globals && !alloc_remove(m->globals, 1u << A_MODULE, &a))
        alloc_drop(&a);
    free(m->global_at);
    simgpu_image_free(&m->image);
    handle_free(m);
}

SIMGPU_EXPORT CUresult cuModuleUnload(CUmodule m)
{
    REQUIRE_INIT();
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(m);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule m, const char *name)
{
    REQUIRE_INIT();
    if (!hfunc || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = CUDA_SUCCESS;
    *hfunc = function_get(m, name, &err);
    return err;
}

/* A variable of the module's image: its address and its symbol's size (st_size).  An
 * image whose symbols simgpu cannot read (PTX, which it does not compile; a stand-in or
 * compressed image) holds none. */
static CUresult module_global(struct vgpu_module *m, const char *name, CUdeviceptr *dptr, size_t *bytes)
{
    const struct simgpu_global *g = simgpu_image_global(&m->image, name);
    if (!g)
        return CUDA_ERROR_NOT_FOUND;
    if (dptr)
        *dptr = m->globals + m->global_at[g - m->image.globals];
    if (bytes)
        *bytes = (size_t)g->size;
    return CUDA_SUCCESS;
}

/* cuda.h, cuModuleGetGlobal (_v2, CUDA 3.2): "Returns in *dptr and *bytes the base pointer
 * and size of the global of name name located in module hmod.  If no variable of that name
 * exists, cuModuleGetGlobal() returns CUDA_ERROR_NOT_FOUND.  One of the parameters dptr or
 * bytes (not both) can be NULL in which case it is ignored." */
SIMGPU_EXPORT CUresult cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule m, const char *name)
{
    REQUIRE_INIT();
    if ((!dptr && !bytes) || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_global(m, name, dptr, bytes);
}

SIMGPU_EXPORT CUresult cuModuleGetFunctionCount(unsigned int *count, CUmodule m)
{
    REQUIRE_INIT();
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    *count = (unsigned)m->image.count;   /* a stand-in image names none */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuModuleEnumerateFunctions(CUfunction *functions, unsigned int numFunctions, CUmodule m)
{
    REQUIRE_INIT();
    if (!functions)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(m, K_MODULE))
        return CUDA_ERROR_INVALID_HANDLE;
    for (unsigned i = 0; i < numFunctions && i < m->image.count; i++) {
        CUresult err = CUDA_SUCCESS;
        if (!(functions[i] = function_get(m, m->image.kernels[i].name, &err)))
            return err;
    }
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuModuleGetLoadingMode(int *mode)
{
    REQUIRE_INIT();
    if (!mode)
        return CUDA_ERROR_INVALID_VALUE;
    *mode = 2;   /* CU_MODULE_LAZY_LOADING, the default since CUDA 12.2 */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncGetModule(CUmodule *hmod, CUfunction f)
{
    REQUIRE_INIT();
    if (!hmod)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *hmod = f->module;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncIsLoaded(int *state, CUfunction f)
{
    REQUIRE_INIT();
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *state = 1;   /* CU_FUNCTION_LOADING_STATE_LOADED */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncLoad(CUfunction f)
{
    REQUIRE_INIT();
    return handle_ok(f, K_FUNCTION) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

SIMGPU_EXPORT CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                         void **jitOptionsValues, unsigned int numJitOptions,
                                         void *libraryOptions, void **libraryOptionValues,
                                         unsigned int numLibraryOptions)
{
    (void)libraryOptions, (void)libraryOptionValues, (void)numLibraryOptions;
    REQUIRE_INIT();
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    struct jit_log log;
    CUresult r = jit_options(numJitOptions, jitOptions, jitOptionsValues, &log);
    if (r != CUDA_SUCCESS)
        return r;
    struct vgpu_library *l = handle_new(K_LIBRARY);
    if (!l)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if ((r = module_new(&l->module, code, 0, &log)) != CUDA_SUCCESS) {
        handle_free(l);
        return r;
    }
    l->module->library = l;
    *library = l;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLibraryLoadFromFile(CUlibrary *library, const char *fileName, CUjit_option *jitOptions,
                                             void **jitOptionsValues, unsigned int numJitOptions,
                                             void *libraryOptions, void **libraryOptionValues,
                                             unsigned int numLibraryOptions)
{
    REQUIRE_INIT();
    CUresult r;
    size_t size;
    void *data = read_file(fileName, &size, &r);
    if (!data)
        return r;
    r = cuLibraryLoadData(library, data, jitOptions, jitOptionsValues, numJitOptions, libraryOptions,
                          libraryOptionValues, numLibraryOptions);
    free(data);
    return r;
}

SIMGPU_EXPORT CUresult cuLibraryUnload(CUlibrary l)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    module_free(l->module);
    handle_free(l);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary l, const char *name)
{
    REQUIRE_INIT();
    if (!pKernel || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult err = CUDA_SUCCESS;
    *pKernel = function_get(l->module, name, &err);
    return err;
}

SIMGPU_EXPORT CUresult cuLibraryGetKernelCount(unsigned int *count, CUlibrary l)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    return cuModuleGetFunctionCount(count, l->module);
}

SIMGPU_EXPORT CUresult cuLibraryGetModule(CUmodule *pMod, CUlibrary l)
{
    REQUIRE_INIT();
    if (!pMod)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    *pMod = l->module;
    return CUDA_SUCCESS;
}

/* cuda.h, cuLibraryGetGlobal: "the base pointer and size of the global with name name for
 * the requested library library and the current context"; CUDA_ERROR_NOT_FOUND if there
 * is none; dptr or bytes (not both) may be NULL.  (simgpu's library is one module for
 * every context: one copy of its variables.) */
SIMGPU_EXPORT CUresult cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary l, const char *name)
{
    REQUIRE_CTX(c);
    (void)c;
    if ((!dptr && !bytes) || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(l, K_LIBRARY))
        return CUDA_ERROR_INVALID_HANDLE;
    return module_global(l->module, name, dptr, bytes);
}

/* cuda.h, cuKernelGetLibrary: "Returns in pLib the handle of the library for the requested
 * kernel".  A function of a module loaded with cuModuleLoad* is no library's kernel:
 * CUDA_ERROR_INVALID_HANDLE. */
SIMGPU_EXPORT CUresult cuKernelGetLibrary(CUlibrary *pLib, CUkernel k)
{
    REQUIRE_INIT();
    if (!pLib)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(k, K_FUNCTION) || !k->module->library)
        return CUDA_ERROR_INVALID_HANDLE;
    *pLib = k->module->library;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel k)
{
    REQUIRE_INIT();
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(k, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *pFunc = k;   /* one object serves as kernel and function */
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncGetName(const char **name, CUfunction f)
{
    REQUIRE_INIT();
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuKernelGetName(const char **name, CUkernel k) { return cuFuncGetName(name, k); }

/* === function attributes and occupancy ===
 * Resources come from the image: registers, local (frame) and static shared memory and
 * the thread limit that a cubin records; PTX is not compiled here, so a kernel loaded as
 * PTX reports no registers or local memory.  The limits are the device's: a block's
 * threads are bounded by its registers (allocated per warp in units of 256) and by
 * 1024 or the kernel's .maxntid; occupancy follows the same per-SM limits (threads,
 * blocks, registers, shared memory in 128-byte units plus the 1 KiB the driver reserves
 * per block), as NVIDIA's occupancy calculator computes them. */

struct sm_limits { int threads, blocks, regs, smem, smem_optin, smem_reserved; };

static struct sm_limits sm_limits(void)
{
    const struct simgpu_profile *p = simgpu_profile();
    return (struct sm_limits){p->threads_per_sm, p->blocks_per_sm, 65536, p->smem_per_sm, p->smem_per_block_optin, 1024};
}

static int regs_per_warp(const struct vgpu_function *f) { return (f->info.regs * 32 + 255) / 256 * 256; }

static int func_max_threads(const struct vgpu_function *f)
{
    int t = f->info.max_threads ? f->info.max_threads : 1024;
    if (f->info.regs) {
        int warps = 65536 / regs_per_warp(f);
        if (warps * 32 < t)
            t = warps * 32;
    }
    return t;
}

SIMGPU_EXPORT CUresult cuFuncGetAttribute(int *pi, int attrib, CUfunction f)
{
    REQUIRE_INIT();
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    struct sm_limits lim = sm_limits();
    int cc = device_cc();
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = func_max_threads(f); break;
    case CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: *pi = f->info.shared_bytes; break;
    case CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES: *pi = f->info.local_bytes; break;
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *pi = f->info.regs; break;
    case CU_FUNC_ATTRIBUTE_PTX_VERSION:   /* the architecture the code was written for */
        *pi = f->module && f->module->image.arch ? f->module->image.arch : cc;
        break;
    case CU_FUNC_ATTRIBUTE_BINARY_VERSION:   /* the SASS that runs: the cubin's, or JIT-compiled for this device */
        *pi = f->module && f->module->image.arch && !f->module->image.ptx_version ? f->module->image.arch : cc;
        break;
    case CU_FUNC_ATTRIBUTE_CACHE_MODE_CA: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        *pi = f->max_dynamic_shared ? f->max_dynamic_shared : 49152 - f->info.shared_bytes;
        break;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: *pi = f->carveout; break;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET: *pi = 0; break;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
        *pi = f->cluster[attrib - CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH];
        break;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED: *pi = f->non_portable_cluster; break;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE: *pi = f->cluster_policy; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    (void)lim;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuFuncSetAttribute(CUfunction f, int attrib, int value)
{
    REQUIRE_INIT();
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    struct sm_limits lim = sm_limits();
    int cluster_ok = simgpu_profile()->cc_major >= 9;
    switch (attrib) {
    case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        /* static + dynamic may not pass the opt-in limit */
        if (value < 0 || value + f->info.shared_bytes > lim.smem_optin)
            return CUDA_ERROR_INVALID_VALUE;
        f->max_dynamic_shared = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
        if (value < -1 || value > 100)
            return CUDA_ERROR_INVALID_VALUE;
        f->carveout = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT:
    case CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH:
        if (!cluster_ok || value < 0)
            return CUDA_ERROR_NOT_SUPPORTED;
        f->cluster[attrib - CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH] = value;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED:
        if (!cluster_ok)
            return CUDA_ERROR_NOT_SUPPORTED;
        f->non_portable_cluster = value != 0;
        return CUDA_SUCCESS;
    case CU_FUNC_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE:
        if (!cluster_ok)
            return CUDA_ERROR_NOT_SUPPORTED;
        f->cluster_policy = value;
        return CUDA_SUCCESS;
    default:
        return attrib >= 0 && attrib < CU_FUNC_ATTRIBUTE_MAX ? CUDA_ERROR_INVALID_VALUE   /* read-only */
                                                             : CUDA_ERROR_INVALID_VALUE;
    }
}

SIMGPU_EXPORT CUresult cuFuncSetCacheConfig(CUfunction f, int config)
{
    REQUIRE_INIT();
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (config < 0 || config > 3)   /* CU_FUNC_CACHE_PREFER_NONE .. _EQUAL */
        return CUDA_ERROR_INVALID_VALUE;
    f->cache_config = config;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuKernelGetAttribute(int *pi, int attrib, CUkernel k, CUdevice dev)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    return cuFuncGetAttribute(pi, attrib, k);
}

SIMGPU_EXPORT CUresult cuKernelSetAttribute(int attrib, int val, CUkernel k, CUdevice dev)
{
    REQUIRE_INIT();
    if (!dev_ok(dev))
        return CUDA_ERROR_INVALID_DEVICE;
    return cuFuncSetAttribute(k, attrib, val);
}

/* Blocks of `block` threads using `smem` dynamic shared memory that fit on one SM. */
static int blocks_per_sm(const struct vgpu_function *f, int block, size_t smem)
{
    struct sm_limits lim = sm_limits();
    if (block <= 0 || block > func_max_threads(f) ||
        smem + (size_t)f->info.shared_bytes > (size_t)lim.smem_optin)
        return 0;
    int warps = (block + 31) / 32;
    int n = lim.blocks;
    if (lim.threads / (warps * 32) < n)
        n = lim.threads / (warps * 32);
    if (f->info.regs) {
        int by_regs = lim.regs / (regs_per_warp(f) * warps);
        if (by_regs < n)
            n = by_regs;
    }
    size_t per_block = (smem + (size_t)f->info.shared_bytes + 127) / 128 * 128 + (size_t)lim.smem_reserved;
    if ((size_t)lim.smem / per_block < (size_t)n)
        n = (int)((size_t)lim.smem / per_block);
    return n;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int *numBlocks, CUfunction f, int blockSize,
                                                                            size_t dynamicSMemSize, unsigned int flags)
{
    REQUIRE_INIT();
    if (!numBlocks || flags > CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    *numBlocks = blocks_per_sm(f, blockSize, dynamicSMemSize);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction f, int blockSize,
                                                                   size_t dynamicSMemSize)
{
    return cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(numBlocks, f, blockSize, dynamicSMemSize, 0);
}

/* The block size (a multiple of the warp size, up to blockSizeLimit) with the most
 * resident threads per SM; the smallest grid that fills the device with it. */
SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int *minGridSize, int *blockSize, CUfunction f,
                                                                 CUoccupancyB2DSize smemOf, size_t dynamicSMemSize,
                                                                 int blockSizeLimit, unsigned int flags)
{
    REQUIRE_INIT();
    if (!minGridSize || !blockSize || flags > CU_OCCUPANCY_DISABLE_CACHING_OVERRIDE)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    int limit = func_max_threads(f);
    if (blockSizeLimit > 0 && blockSizeLimit < limit)
        limit = blockSizeLimit;
    int best = 0, best_blocks = 0;
    for (int b = (limit + 31) / 32 * 32; b > 0; b -= 32) {
        int size = b > limit ? limit : b;
        int n = blocks_per_sm(f, size, smemOf ? smemOf(size) : dynamicSMemSize);
        if (n * size > best_blocks * best)
            best = size, best_blocks = n;
    }
    *blockSize = best;
    *minGridSize = best_blocks * simgpu_profile()->sm_count;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialBlockSize(int *minGridSize, int *blockSize, CUfunction f,
                                                        CUoccupancyB2DSize smemOf, size_t dynamicSMemSize,
                                                        int blockSizeLimit)
{
    return cuOccupancyMaxPotentialBlockSizeWithFlags(minGridSize, blockSize, f, smemOf, dynamicSMemSize,
                                                     blockSizeLimit, 0);
}

SIMGPU_EXPORT CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t *dynamicSmemSize, CUfunction f, int numBlocks,
                                                               int blockSize)
{
    REQUIRE_INIT();
    if (!dynamicSmemSize || numBlocks <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (blocks_per_sm(f, blockSize, 0) < numBlocks) {
        *dynamicSmemSize = 0;
        return CUDA_SUCCESS;
    }
    struct sm_limits lim = sm_limits();
    size_t per_block = (size_t)lim.smem / (size_t)numBlocks;
    size_t used = (size_t)f->info.shared_bytes + (size_t)lim.smem_reserved;
    size_t avail = per_block > used ? (per_block - used) / 128 * 128 : 0;
    size_t optin = (size_t)lim.smem_optin - (size_t)f->info.shared_bytes;
    *dynamicSmemSize = avail < optin ? avail : optin;
    return CUDA_SUCCESS;
}

/* Clusters (compute capability 9.0): at most 8 blocks portably, 16 when the kernel allows
 * non-portable sizes; as many clusters fit at once as blocks fit on the device's GPCs,
 * modelled here as the device's SMs in groups of the cluster size. */
static int cluster_blocks(const CUlaunchConfig *c)
{
    for (unsigned i = 0; c->attrs && i < c->numAttrs; i++) {
        const unsigned char *a = (const unsigned char *)c->attrs + (size_t)i * 72;   /* sizeof(CUlaunchAttribute) */
        int id;
        memcpy(&id, a, sizeof id);
        if (id == 4) {   /* CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION: value.clusterDim at offset 8 */
            unsigned d[3];
            memcpy(d, a + 8, sizeof d);
            return (int)(d[0] * d[1] * d[2]);
        }
    }
    return 1;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxPotentialClusterSize(int *clusterSize, CUfunction f, const CUlaunchConfig *config)
{
    REQUIRE_INIT();
    if (!clusterSize || !config)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (simgpu_profile()->cc_major < 9)
        return CUDA_ERROR_NOT_SUPPORTED;
    *clusterSize = f->non_portable_cluster ? 16 : 8;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction f, const CUlaunchConfig *config)
{
    REQUIRE_INIT();
    if (!numClusters || !config)
        return CUDA_ERROR_INVALID_VALUE;
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (simgpu_profile()->cc_major < 9)
        return CUDA_ERROR_NOT_SUPPORTED;
    int size = cluster_blocks(config), limit = f->non_portable_cluster ? 16 : 8;
    if (size > limit)
        return CUDA_ERROR_INVALID_VALUE;
    int per_sm = blocks_per_sm(f, (int)(config->blockDimX * config->blockDimY * config->blockDimZ),
                               config->sharedMemBytes);
    *numClusters = per_sm * simgpu_profile()->sm_count / size;
    return CUDA_SUCCESS;
}

/* === the linker (cuLink*) ===
 * Inputs are read as their declared type (simgpu/image.h) and their kernels gathered;
 * cuLinkComplete writes them as one cubin (owned by the link state until cuLinkDestroy)
 * that cuModuleLoadData loads.  No code is compiled or linked: unresolved externals are
 * not detected; a kernel defined by two inputs is an error, as in nvlink. */

static CUresult link_log_error(struct vgpu_link *l, const char *line)
{
    struct jit_log *log = l->options;
    jit_append(log->error, log->error_cap, &log->error_len, line);
    jit_done(log);
    return CUDA_ERROR_INVALID_IMAGE;
}

SIMGPU_EXPORT CUresult cuLinkCreate_v2(unsigned int numOptions, CUjit_option *options, void **optionValues,
                                       CUlinkState *stateOut)
{
    REQUIRE_CTX(c);
    (void)c;
    if (!stateOut)
        return CUDA_ERROR_INVALID_VALUE;
    struct jit_log *log = malloc(sizeof *log);
    if (!log)
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult r = jit_options(numOptions, options, optionValues, log);
    if (r != CUDA_SUCCESS) {
        free(log);
        return r;
    }
    struct vgpu_link *l = handle_new(K_LINK);
    if (!l) {
        free(log);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    l->options = log;
    l->image.names_known = 1;
    jit_done(log);
    *stateOut = l;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLinkAddData_v2(CUlinkState l, CUjitInputType type, void *data, size_t size, const char *name,
                                        unsigned int numOptions, CUjit_option *options, void **optionValues)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!data || !size || l->cubin)
        return CUDA_ERROR_INVALID_VALUE;
    struct jit_log local;
    CUresult r = jit_options(numOptions, options, optionValues, &local);   /* checked; the link's logs are used */
    if (r != CUDA_SUCCESS)
        return r;
    struct simgpu_image img;
    if ((r = read_image(data, size, type, name, l->options, &img)) != CUDA_SUCCESS) {
        jit_done(l->options);
        return r;
    }
    char why[256] = "";
    r = simgpu_image_merge(&l->image, &img, why, sizeof why);
    simgpu_image_free(&img);
    if (r != CUDA_SUCCESS) {
        char line[400];
        snprintf(line, sizeof line, "error   : %s: %s", name ? name : "input", why);
        return link_log_error(l, line);
    }
    l->inputs++;
    jit_done(l->options);
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLinkAddFile_v2(CUlinkState l, CUjitInputType type, const char *path, unsigned int numOptions,
                                        CUjit_option *options, void **optionValues)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    CUresult r;
    size_t size;
    void *data = read_file(path, &size, &r);
    if (!data)
        return r;
    r = size ? cuLinkAddData_v2(l, type, data, size, path, numOptions, options, optionValues) : CUDA_ERROR_INVALID_IMAGE;
    free(data);
    return r;
}

SIMGPU_EXPORT CUresult cuLinkComplete(CUlinkState l, void **cubinOut, size_t *sizeOut)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!cubinOut || !sizeOut)
        return CUDA_ERROR_INVALID_VALUE;
    if (!l->cubin) {
        if (!l->inputs)
            return link_log_error(l, "error   : no input files");
        if (!(l->cubin = simgpu_image_write(&l->image, device_cc(), &l->cubin_size)))
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    struct jit_log *log = l->options;
    if (log->verbose) {
        char line[200];
        snprintf(line, sizeof line, "info    : simgpu: linked %zu kernel(s) from %d input(s) for sm_%d", l->image.count,
                 l->inputs, device_cc());
        jit_append(log->info, log->info_cap, &log->info_len, line);
    }
    jit_done(log);
    *cubinOut = l->cubin;
    *sizeOut = l->cubin_size;
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLinkDestroy(CUlinkState l)
{
    REQUIRE_INIT();
    if (!handle_ok(l, K_LINK))
        return CUDA_ERROR_INVALID_HANDLE;
    free(l->cubin);
    free(l->options);
    simgpu_image_free(&l->image);
    handle_free(l);
    return CUDA_SUCCESS;
}

/* === launch === */

uint64_t kernel_ns(int dev, const struct vgpu_function *f, uint64_t blocks)
{
    uint64_t sms = (uint64_t)simgpu_view_sm_count(dev);   /* a wave: as many blocks as SMs */
    uint64_t waves = (blocks + sms - 1) / sms;
    return waves * f->us_per_wave * 1000ull;
}

/* Queue `dur_ns` on the stream's device, blocking while the stream's queue is full. */
void stream_enqueue(struct vgpu_stream *s, uint64_t dur_ns)
{
    pthread_mutex_lock(&s->lock);
    if (s->pending_count == SIMGPU_QUEUE_DEPTH) {
        uint64_t oldest = s->pending[s->pending_head];
        if (oldest > simgpu_now_ns())
            simgpu_sleep_until(oldest);   /* a full queue blocks like a real one */
        s->pending_head = (s->pending_head + 1) % SIMGPU_QUEUE_DEPTH;
        s->pending_count--;
    }
    uint64_t end = simgpu_enqueue(s->ctx->dev, dur_ns);
    s->pending[(s->pending_head + s->pending_count++) % SIMGPU_QUEUE_DEPTH] = end;
    __atomic_store_n(&s->last_end, end, __ATOMIC_RELEASE);
    struct vgpu_ctx *c = s->ctx;
    uint64_t prev = __atomic_load_n(&c->last_end, __ATOMIC_RELAXED);
    while (prev < end && !__atomic_compare_exchange_n(&c->last_end, &prev, end, 1, __ATOMIC_RELEASE,
                                                      __ATOMIC_RELAXED))
        ;
    pthread_mutex_unlock(&s->lock);
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                       unsigned bz, unsigned shmem, void **kernelParams, void **extra, CUstream h)
{
    REQUIRE_INIT();
    if (!handle_ok(f, K_FUNCTION))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!gx || !gy || !gz || !bx || !by || !bz || (uint64_t)bx * by * bz > 1024)
        return CUDA_ERROR_INVALID_VALUE;
    CUresult err;
    struct vgpu_stream *s = resolve_stream(h, &err);
    if (!s)
        return err;
    uint64_t blocks = (uint64_t)gx * gy * gz;
    if (s->capture) {   /* a kernel node, with the launch's parameters (cuGraphKernelNodeGetParams) */
        CUDA_KERNEL_NODE_PARAMS p = {f, gx, gy, gz, bx, by, bz, shmem, kernelParams, extra, NULL, NULL};
        struct vgpu_graph_node *n = graph_node_new(s->capture, CU_GRAPH_NODE_TYPE_KERNEL);
        CUresult r = n ? graph_add_kernel(s->capture, f, blocks) : CUDA_ERROR_OUT_OF_MEMORY;
        if (r == CUDA_SUCCESS && !(n->kp = kernel_params_new(&p, f)))
            r = CUDA_ERROR_OUT_OF_MEMORY;
        if (n && r != CUDA_SUCCESS)
            graph_drop_node(n);
        else if (n)
            s->capture_last = n;
        return r;
    }
    stream_enqueue(s, kernel_ns(s->ctx->dev, f, blocks));
    return CUDA_SUCCESS;
}

SIMGPU_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                      unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                                      unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                                      void **kernelParams, void **extra)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, kernelParams,
                  extra, hStream);
}

SIMGPU_EXPORT CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                           unsigned int gridDimZ, unsigned int blockDimX,
                                           unsigned int blockDimY, unsigned int blockDimZ,
                                           unsigned int sharedMemBytes, CUstream hStream,
                                           void **kernelParams, void **extra)
{
    PER_THREAD(cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                              sharedMemBytes, hStream, kernelParams, extra));
}

SIMGPU_EXPORT CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                                        void **extra)
{
    REQUIRE_INIT();
    if (!config)
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->sharedMemBytes, kernelParams, extra,
                  config->hStream);
}

SIMGPU_EXPORT CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                             void **kernelParams, void **extra)
{
    PER_THREAD(cuLaunchKernelEx(config, f, kernelParams, extra));
}

SIMGPU_EXPORT CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                                 unsigned int gridDimZ, unsigned int blockDimX,
                                                 unsigned int blockDimY, unsigned int blockDimZ,
                                                 unsigned int sharedMemBytes, CUstream hStream,
                                                 void **kernelParams)
{
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, kernelParams,
                  NULL, hStream);
}

SIMGPU_EXPORT CUresult cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                                      unsigned int gridDimY, unsigned int gridDimZ,
                                                      unsigned int blockDimX, unsigned int blockDimY,
                                                      unsigned int blockDimZ, unsigned int sharedMemBytes,
                                                      CUstream hStream, void **kernelParams)
{
    PER_THREAD(cuLaunchCooperativeKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                                         sharedMemBytes, hStream, kernelParams));
}

/* === tensor maps ===
 * cuda.h, cuTensorMapEncodeTiled: "Tensor map objects are only supported on devices of
 * compute capability 9.0 or higher" (others: CUDA_ERROR_NOT_SUPPORTED, the current
 * context's device deciding), and "a tensor map object is an opaque value": simgpu writes
 * its own encoding of the arguments.  Each documented requirement on the arguments is
 * checked (CUDA_ERROR_INVALID_VALUE): the map 64-byte aligned; a known data type; rank 1
 * to 5 (at least 3 when interleaved); globalAddress 16-byte aligned (32 with
 * CU_TENSOR_MAP_INTERLEAVE_32B or the 16-byte-aligned packed types); each globalDim
 * non-zero and at most 2^32 (a multiple of 128 for the 16-byte-aligned packed types, of 2
 * for 16U4_ALIGN8B); each globalStride a multiple of 16 (32 as for the address) below 2^40;
 * each boxDim 1 to 256, the inner box a multiple of 16 bytes without interleave, 128
 * elements for the 16-byte-aligned packed types; each elementStride 1 to 8; known
 * interleave, swizzle, L2 promotion and fill values; INTERLEAVE_32B only with SWIZZLE_32B;
 * a swizzled inner box no wider than its span; the swizzles each packed type allows;
 * 16U6_ALIGN16B without interleave; the NaN fill for floating-point types only. */

/* Memory per element in half-bytes (the packed types: 16 values in 8 or 16 bytes). */
static unsigned tensor_nibbles(unsigned t)
{
    static const unsigned nibbles[] = {2, 4, 8, 8, 16, 16, 4, 8, 16, 4, 8, 8, 8, 1, 2, 2};
    return t < sizeof nibbles / sizeof nibbles[0] ? nibbles[t] : 0;
}

/* tensorMap is a CUtensorMap *; taken as void * so that its alignment is checked, not assumed. */
SIMGPU_EXPORT CUresult cuTensorMapEncodeTiled(void *tensorMap, CUtensorMapDataType tensorDataType,
                                              uint32_t tensorRank, void *globalAddress, const cuuint64_t *globalDim,
                                              const cuuint64_t *globalStrides, const uint32_t *boxDim,
                                              const uint32_t *elementStrides, CUtensorMapInterleave interleave,
                                              CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2Promotion,
                                              CUtensorMapFloatOOBfill oobFill)
{
    REQUIRE_CTX(c);
    (void)c;
    unsigned t = (unsigned)tensorDataType, il = (unsigned)interleave, sw = (unsigned)swizzle;
    int packed16 = t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B || t == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B;
    int packed = packed16 || t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B;
    unsigned align32 = il == CU_TENSOR_MAP_INTERLEAVE_32B || packed16 ? 32 : 16;
    if (!tensorMap || (uintptr_t)tensorMap % 64 || !tensor_nibbles(t) || !tensorRank || tensorRank > 5 ||
        il > CU_TENSOR_MAP_INTERLEAVE_32B || (il != CU_TENSOR_MAP_INTERLEAVE_NONE && tensorRank < 3) ||
        sw > CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B || (unsigned)l2Promotion > CU_TENSOR_MAP_L2_PROMOTION_L2_256B ||
        (unsigned)oobFill > CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA ||
        (uintptr_t)globalAddress % align32 || !globalDim || !boxDim || !elementStrides ||
        (tensorRank > 1 && !globalStrides))
        return CUDA_ERROR_INVALID_VALUE;
    for (uint32_t i = 0; i < tensorRank; i++)
        if (!globalDim[i] || globalDim[i] > (1ull << 32) || !boxDim[i] || boxDim[i] > 256 || !elementStrides[i] ||
            elementStrides[i] > 8 || (i + 1 < tensorRank && (globalStrides[i] % align32 || globalStrides[i] >= (1ull << 40))))
            return CUDA_ERROR_INVALID_VALUE;
    uint64_t inner = (uint64_t)boxDim[0] * tensor_nibbles(t) / 2;   /* bytes of the box's inner dimension */
    static const unsigned span[] = {0, 32, 64, 128, 128, 128, 128};
    if ((packed16 && (globalDim[0] % 128 || boxDim[0] != 128)) ||
        (t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN8B && globalDim[0] % 2) ||
        (il == CU_TENSOR_MAP_INTERLEAVE_NONE && inner % 16) ||
        (il == CU_TENSOR_MAP_INTERLEAVE_32B && sw != CU_TENSOR_MAP_SWIZZLE_32B) ||
        (il == CU_TENSOR_MAP_INTERLEAVE_NONE && sw != CU_TENSOR_MAP_SWIZZLE_NONE && inner > span[sw]) ||
        (t == CU_TENSOR_MAP_DATA_TYPE_16U6_ALIGN16B &&
         (il != CU_TENSOR_MAP_INTERLEAVE_NONE ||
          (sw != CU_TENSOR_MAP_SWIZZLE_NONE && sw != CU_TENSOR_MAP_SWIZZLE_128B &&
           sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B && sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_64B))) ||
        (t == CU_TENSOR_MAP_DATA_TYPE_16U4_ALIGN16B && sw != CU_TENSOR_MAP_SWIZZLE_NONE &&
         sw != CU_TENSOR_MAP_SWIZZLE_128B && sw != CU_TENSOR_MAP_SWIZZLE_128B_ATOM_32B))
        return CUDA_ERROR_INVALID_VALUE;
    int floating = t == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 || t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ||
                   t == CU_TENSOR_MAP_DATA_TYPE_FLOAT64 || t == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ||
                   t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ || t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
                   t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ;
    if (oobFill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && (!floating || packed))
        return CUDA_ERROR_INVALID_VALUE;
    if (simgpu_profile()->cc_major < 9)
        return CUDA_ERROR_NOT_SUPPORTED;
    /* simgpu's encoding: address; the enums and rank; dims; strides; box and element strides */
    uint64_t *o = tensorMap;
    memset(o, 0, sizeof(CUtensorMap));
    o[0] = (uint64_t)(uintptr_t)globalAddress;
    o[1] = t | (uint64_t)tensorRank << 8 | (uint64_t)il << 12 | (uint64_t)sw << 16 | (uint64_t)l2Promotion << 20 |
           (uint64_t)oobFill << 24;
    for (uint32_t i = 0; i < tensorRank; i++) {
        o[2 + i] = globalDim[i];
        if (i + 1 < tensorRank)
            o[7 + i] = globalStrides[i];
        o[11] |= (uint64_t)(boxDim[i] - 1) << (8 * i);
        o[12] |= (uint64_t)(elementStrides[i] - 1) << (4 * i);
    }
    return CUDA_SUCCESS;
}
