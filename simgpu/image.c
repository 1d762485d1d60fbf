/* simgpu images: reading PTX, CUDA ELF, fatbins and archives; writing cubins (image.h).
 *
 * Layouts used, as NVIDIA's tools show them (cuobjdump -elf, readelf):
 *   CUDA ELF: ELFCLASS64, little endian, e_machine EM_CUDA (190); the SM is e_flags & 0xff
 *     for ELF ABI version 7 and (e_flags >> 8) & 0xff from version 8.  Kernels are FUNC
 *     symbols marked STO_CUDA_ENTRY (st_other 0x10).  .nv.info holds attributes as
 *     records {u8 format, u8 attribute, u16 size or value}: format 4 (SVAL) is followed by
 *     `size` bytes; EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11) carry {u32 symbol,
 *     u32 value}; .nv.info.<kernel> carries EIATTR_MAX_THREADS (0x05) / EIATTR_REQNTID
 *     (0x10) as {u32 x, y, z} and one EIATTR_KPARAM_INFO (0x17) per parameter as {u32
 *     index, u16 ordinal, u16 offset, u32 flags: the size in bits 18 and up};
 *     .nv.shared.<kernel> is the kernel's static shared memory.  Variables are OBJECT
 *     symbols (st_value: offset in their section, st_size: bytes) of .nv.global (NOBITS:
 *     zeros), .nv.global.init and .nv.constant<N> (initial bytes in the section).
 *   fatbin: {u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size of the entries},
 *     each entry {u16 kind (1 PTX, 2 ELF), u16, u32 header size, u64 payload size, ...,
 *     u32 arch at 0x1c, u64 flags at 0x28 (0x2000 or 0x8000: payload compressed)}.
 *   fatbin wrapper (what nvcc embeds): {u32 magic 0x466243B1, u32 version, u64 fatbin
 *     pointer, u64 unused}.
 *   ar archive: "!<arch>\n", then members of a 60-byte header (size in decimal at 48).
 */
#define _GNU_SOURCE
#include "simgpu/image.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* CUresult values used here (cuda_abi.h names them; repeated so this file needs no CUDA header) */
enum { R_SUCCESS = 0, R_INVALID_VALUE = 1, R_OUT_OF_MEMORY = 2, R_INVALID_IMAGE = 200,
       R_NO_BINARY_FOR_GPU = 209, R_INVALID_PTX = 218, R_UNSUPPORTED_PTX_VERSION = 222,
       R_NOT_SUPPORTED = 801 };

#define DRIVER_PTX_ISA 90   /* the newest PTX ISA a CUDA 13.0 driver compiles (PTX ISA 9.0) */

#define EM_CUDA 190
#define STO_CUDA_ENTRY 0x10
#define SHT_SYMTAB 2
#define SHT_NOBITS 8
#define STT_OBJECT 1
#define STT_FUNC 2
#define EIFMT_SVAL 4
#define EIATTR_MAX_THREADS 0x05
#define EIATTR_REQNTID 0x10
#define EIATTR_FRAME_SIZE 0x11
#define EIATTR_REGCOUNT 0x2f
#define EIATTR_KPARAM_INFO 0x17
#define KPARAM_SIZE_SHIFT 18
#define KPARAM_CBANK (0x1fu << 12)   /* "Parameter Space: CBANK", as ptxas writes it */
#define FATBIN_MAGIC 0xBA55ED50u
#define FATBIN_WRAPPER_MAGIC 0x466243B1u
#define FATBIN_COMPRESSED (0x2000ull | 0x8000ull)

static int fail(char *log, size_t loglen, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int fail(char *log, size_t loglen, int code, const char *fmt, ...)
{
    if (log && loglen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(log, loglen, fmt, ap);
        va_end(ap);
    }
    return code;
}

static uint16_t u16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t u32(const unsigned char *p) { return (uint32_t)u16(p) | (uint32_t)u16(p + 2) << 16; }
static uint64_t u64(const unsigned char *p) { return (uint64_t)u32(p) | (uint64_t)u32(p + 4) << 32; }

static struct simgpu_kernel *add_kernel(struct simgpu_image *img, const char *name, size_t len)
{
    for (size_t i = 0; i < img->count; i++)
        if (strlen(img->kernels[i].name) == len && !memcmp(img->kernels[i].name, name, len))
            return &img->kernels[i];
    struct simgpu_kernel *k = realloc(img->kernels, (img->count + 1) * sizeof *k);
    if (!k)
        return NULL;
    img->kernels = k;
    k = &img->kernels[img->count];
    memset(k, 0, sizeof *k);
    if (!(k->name = strndup(name, len)))
        return NULL;
    img->count++;
    return k;
}

void simgpu_image_free(struct simgpu_image *img)
{
    for (size_t i = 0; i < img->count; i++) {
        free(img->kernels[i].name);
        free(img->kernels[i].params);
    }
    free(img->kernels);
    for (size_t i = 0; i < img->nglobals; i++) {
        free(img->globals[i].name);
        free(img->globals[i].init);
    }
    free(img->globals);
    memset(img, 0, sizeof *img);
}

const struct simgpu_global *simgpu_image_global(const struct simgpu_image *img, const char *name)
{
    for (size_t i = 0; i < img->nglobals; i++)
        if (!strcmp(img->globals[i].name, name))
            return &img->globals[i];
    return NULL;
}

/* Parameter `ordinal` of k (the array grows to hold it); NULL when out of memory. */
static struct simgpu_param *kernel_param(struct simgpu_kernel *k, unsigned ordinal)
{
    if (ordinal >= 4096)
        return NULL;   /* CUDA's parameter space holds 32 KiB: no kernel has this many */
    if ((int)ordinal >= k->nparams) {
        struct simgpu_param *p = realloc(k->params, (ordinal + 1) * sizeof *p);
        if (!p)
            return NULL;
        memset(p + k->nparams, 0, (ordinal + 1 - (unsigned)k->nparams) * sizeof *p);
        k->params = p;
        k->nparams = (int)ordinal + 1;
    }
    return &k->params[ordinal];
}

const struct simgpu_kernel *simgpu_image_find(const struct simgpu_image *img, const char *name)
{
    for (size_t i = 0; i < img->count; i++)
        if (!strcmp(img->kernels[i].name, name))
            return &img->kernels[i];
    return NULL;
}

/* Can SASS for sm `arch` run on a device of compute capability `cc`?  Same major
 * version, minor no newer than the device's (sm_80 code runs on 8.6, not the reverse). */
static int sass_runs_on(int arch, int cc) { return arch / 10 == cc / 10 && arch % 10 <= cc % 10; }

/* === PTX === */

static const char *skip_space_and_comments(const char *p, const char *end)
{
    for (;;) {
        while (p < end && isspace((unsigned char)*p))
            p++;
        if (p + 1 < end && p[0] == '/' && p[1] == '/') {
            while (p < end && *p != '\n')
                p++;
        } else if (p + 1 < end && p[0] == '/' && p[1] == '*') {
            const char *c = memmem(p + 2, (size_t)(end - p - 2), "*/", 2);
            p = c ? c + 2 : end;
        } else {
            return p;
        }
    }
}

static int ident_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == '$' || c == '.'; }

/* Is the directive `word` at p (and not a longer word)? */
static int directive(const char *p, const char *end, const char *word)
{
    size_t n = strlen(word);
    return (size_t)(end - p) >= n && !memcmp(p, word, n) && (p + n == end || !ident_char(p[n]));
}

/* Bytes of a PTX fundamental type (.u32, .f16x2, .b8, ...); 0 if it is none. */
static unsigned ptx_type_size(const char *t, size_t n)
{
    static const struct { const char *name; unsigned size; } types[] = {
        {".b8", 1}, {".u8", 1}, {".s8", 1}, {".b16", 2}, {".u16", 2}, {".s16", 2}, {".f16", 2},
        {".bf16", 2}, {".b32", 4}, {".u32", 4}, {".s32", 4}, {".f32", 4}, {".f16x2", 4},
        {".bf16x2", 4}, {".b64", 8}, {".u64", 8}, {".s64", 8}, {".f64", 8}, {".b128", 16},
        {".texref", 8}, {".samplerref", 8}, {".surfref", 8}};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (strlen(types[i].name) == n && !memcmp(types[i].name, t, n))
            return types[i].size;
    return 0;
}

/* The parameter list of the .entry whose name ends at p: "( .param [.align A] .type name[N],
 * ... )", each parameter at the next offset aligned to A (else to its type's size).  Sets
 * k->params_known when every parameter's size is understood; returns where the list ends
 * (p when the kernel takes none). */
static const char *read_ptx_params(const char *p, const char *end, struct simgpu_kernel *k)
{
    p = skip_space_and_comments(p, end);
    if (p >= end || *p != '(') {
        k->params_known = 1;
        return p;
    }
    p++;
    unsigned offset = 0, ordinal = 0;
    int ok = 1;
    while (p < end) {
        unsigned type = 0, align = 0, count = 1;
        int is_param = 0, pointer = 0;
        while ((p = skip_space_and_comments(p, end)) < end && *p != ',' && *p != ')') {
            if (*p == '[') {   /* an array: name[N] */
                char *e;
                unsigned long n = strtoul(p + 1, &e, 10);
                count = n && n < (1ul << 20) ? count * (unsigned)n : 0;
                p = memchr(p, ']', (size_t)(end - p));
                p = p ? p + 1 : end;
                continue;
            }
            const char *t = p;
            while (p < end && ident_char(*p))
                p++;
            if (p == t) {
                p++;   /* a character no parameter needs */
                continue;
            }
            size_t n = (size_t)(p - t);
            if (n == 6 && !memcmp(t, ".param", 6))
                is_param = 1;
            else if (n == 4 && !memcmp(t, ".ptr", 4))
                pointer = 1;   /* an .align after .ptr is the pointee's */
            else if (n == 6 && !memcmp(t, ".align", 6)) {
                char *e;
                unsigned long a = strtoul(p, &e, 10);
                if (!pointer)
                    align = (unsigned)a;
                p = e;
            } else if (ptx_type_size(t, n))
                type = ptx_type_size(t, n);
        }
        if (is_param) {
            struct simgpu_param *q = type && count ? kernel_param(k, ordinal++) : NULL;
            if (!q) {
                ok = 0;
            } else {
                unsigned a = align ? align : type;
                offset = (offset + a - 1) / a * a;
                q->offset = offset;
                q->size = type * count;
                offset += q->size;
            }
        }
        if (p >= end || *p++ == ')')
            break;
    }
    k->params_known = ok;
    return p;
}

static int read_ptx(const char *text, size_t size, int cc, struct simgpu_image *img, char *log, size_t loglen)
{
    const char *p = text, *end = text + size;
    int version = -1, target = -1;
    struct simgpu_kernel *last = NULL;
    int depth = 0;   /* braces: directives inside a body are not module directives */
    while ((p = skip_space_and_comments(p, end)) < end) {
        if (*p == '{') {
            depth++, p++;
            continue;
        }
        if (*p == '}') {
            depth--, p++;
            continue;
        }
        if (*p == '"') {   /* a string (e.g. in .file): skip it whole */
            for (p++; p < end && *p != '"'; p++)
                ;
            p++;
            continue;
        }
        if (depth == 0 && directive(p, end, ".version")) {
            unsigned maj, min;
            if (sscanf(p + 8, " %u.%u", &maj, &min) == 2)
                version = (int)(maj * 10 + min);
        } else if (depth == 0 && directive(p, end, ".target")) {
            unsigned sm;
            if (sscanf(p + 7, " sm_%u", &sm) == 1)
                target = (int)sm;
        } else if (depth == 0 && directive(p, end, ".entry")) {
            const char *n = skip_space_and_comments(p + 6, end), *e = n;
            while (e < end && ident_char(*e))
                e++;
            if (e == n)
                return fail(log, loglen, R_INVALID_PTX, "ptx: .entry without a name");
            if (!(last = add_kernel(img, n, (size_t)(e - n))))
                return R_OUT_OF_MEMORY;
            p = read_ptx_params(e, end, last);
            continue;
        } else if (depth == 0 && last && (directive(p, end, ".maxntid") || directive(p, end, ".reqntid"))) {
            unsigned x = 1, y = 1, z = 1;
            if (sscanf(p + 8, " %u , %u , %u", &x, &y, &z) >= 1 && (uint64_t)x * y * z <= 1024)
                last->max_threads = (int)(x * y * z);
        }
        while (p < end && !isspace((unsigned char)*p) && *p != '{' && *p != '}' && *p != '"')
            p++;
    }
    if (version < 0 || target < 0)
        return fail(log, loglen, R_INVALID_PTX, "ptx: no %s directive", version < 0 ? ".version" : ".target");
    if (version > DRIVER_PTX_ISA)
        return fail(log, loglen, R_UNSUPPORTED_PTX_VERSION,
                    "ptx: PTX ISA %d.%d is newer than this driver compiles (%d.%d)", version / 10, version % 10,
                    DRIVER_PTX_ISA / 10, DRIVER_PTX_ISA % 10);
    if (target > cc)
        return fail(log, loglen, R_NO_BINARY_FOR_GPU, "ptx: .target sm_%d is newer than the device (sm_%d)", target,
                    cc);
    img->names_known = 1;
    img->arch = target;
    img->ptx_version = version;
    return R_SUCCESS;
}

/* === CUDA ELF === */

struct elf { const unsigned char *d; size_t size; uint64_t shoff; unsigned shnum, shentsize, shstrndx; };

static int elf_section(const struct elf *e, unsigned i, uint32_t *type, uint64_t *off, uint64_t *size,
                       uint32_t *link, const char **name)
{
    if (i >= e->shnum)
        return -1;
    const unsigned char *s = e->d + e->shoff + (uint64_t)i * e->shentsize;
    *type = u32(s + 4);
    *off = u64(s + 24);
    *size = u64(s + 32);
    *link = u32(s + 40);
    if (*type != SHT_NOBITS && (*off > e->size || *size > e->size - *off))
        return -1;
    if (name) {
        const unsigned char *h = e->d + e->shoff + (uint64_t)e->shstrndx * e->shentsize;
        uint64_t so = u64(h + 24), ss = u64(h + 32);
        uint32_t at = u32(s);
        if (so > e->size || ss > e->size - so || at >= ss || !memchr(e->d + so + at, 0, ss - at))
            return -1;
        *name = (const char *)e->d + so + at;
    }
    return 0;
}

/* The ELF's size from its headers (the end of the last section or of the header table). */
static size_t elf_extent(const unsigned char *d)
{
    uint64_t shoff = u64(d + 0x28);
    unsigned shnum = u16(d + 0x3c), shentsize = u16(d + 0x3a);
    uint64_t end = shoff + (uint64_t)shnum * shentsize;
    for (unsigned i = 0; i < shnum && shentsize >= 64; i++) {
        const unsigned char *s = d + shoff + (uint64_t)i * shentsize;
        if (u32(s + 4) != SHT_NOBITS && u64(s + 24) + u64(s + 32) > end)
            end = u64(s + 24) + u64(s + 32);
    }
    return (size_t)end;
}

/* The variable `sym` (an OBJECT symbol named n) if it lives in global or constant memory:
 * its size, its section's alignment and its initial bytes.  0, or R_OUT_OF_MEMORY. */
static int add_global(const struct elf *e, struct simgpu_image *img, const unsigned char *sym, const char *n)
{
    uint32_t type, link;
    uint64_t off, sz;
    const char *sec;
    unsigned shndx = u16(sym + 6);
    if (shndx >= 0xff00 || elf_section(e, shndx, &type, &off, &sz, &link, &sec) ||
        (strncmp(sec, ".nv.global", 10) && strncmp(sec, ".nv.constant", 12)) || simgpu_image_global(img, n))
        return R_SUCCESS;   /* not a variable a module hands out (shared, local, ...) */
    uint64_t value = u64(sym + 8), bytes = u64(sym + 16);
    if (value > sz || bytes > sz - value)
        return R_SUCCESS;   /* outside its section: not one to hand out */
    struct simgpu_global *g = realloc(img->globals, (img->nglobals + 1) * sizeof *g);
    if (!g)
        return R_OUT_OF_MEMORY;
    img->globals = g;
    g = &img->globals[img->nglobals];
    memset(g, 0, sizeof *g);
    uint64_t align = u64(e->d + e->shoff + (uint64_t)shndx * e->shentsize + 48);
    g->align = align ? align : 1;
    g->size = bytes;
    if (!(g->name = strdup(n)))
        return R_OUT_OF_MEMORY;
    if (type != SHT_NOBITS && bytes) {
        if (!(g->init = malloc(bytes))) {
            free(g->name);
            return R_OUT_OF_MEMORY;
        }
        memcpy(g->init, e->d + off + value, bytes);
    }
    img->nglobals++;
    return R_SUCCESS;
}

static int read_elf(const unsigned char *d, size_t size, int cc, int check_arch, struct simgpu_image *img, char *log,
                    size_t loglen)
{
    if (size < 64 || memcmp(d, "\177ELF", 4) || d[4] != 2 || d[5] != 1)
        return fail(log, loglen, R_INVALID_IMAGE, "not a 64-bit little-endian ELF image");
    if (u16(d + 0x12) != EM_CUDA)
        return fail(log, loglen, R_INVALID_IMAGE, "ELF image for machine %u, not CUDA (%d)", u16(d + 0x12), EM_CUDA);
    struct elf e = {d, size, u64(d + 0x28), u16(d + 0x3c), u16(d + 0x3a), u16(d + 0x3e)};
    if (e.shentsize < 64 || e.shoff > size || (uint64_t)e.shnum * e.shentsize > size - e.shoff || e.shstrndx >= e.shnum)
        return fail(log, loglen, R_INVALID_IMAGE, "ELF section headers out of the image");
    uint32_t flags = u32(d + 0x30);
    int arch = d[8] >= 8 ? (int)((flags >> 8) & 0xff) : (int)(flags & 0xff);
    if (check_arch && !sass_runs_on(arch, cc))
        return fail(log, loglen, R_NO_BINARY_FOR_GPU, "cubin for sm_%d cannot run on this device (sm_%d)", arch, cc);

    /* kernels: entry FUNC symbols; symbol index -> kernel for the .nv.info records */
    unsigned symtab = 0;
    uint32_t type, link;
    uint64_t off, sz;
    const char *name;
    for (unsigned i = 1; i < e.shnum; i++)
        if (!elf_section(&e, i, &type, &off, &sz, &link, NULL) && type == SHT_SYMTAB)
            symtab = i;
    size_t nsyms = 0;
    size_t *by_sym = NULL;   /* symbol -> 1 + kernel index (indices: the array moves as it grows) */
    if (symtab) {
        uint64_t stroff, strsz;
        uint32_t strtype, strlink;
        if (elf_section(&e, symtab, &type, &off, &sz, &link, NULL) ||
            elf_section(&e, link, &strtype, &stroff, &strsz, &strlink, NULL))
            return fail(log, loglen, R_INVALID_IMAGE, "ELF symbol table out of the image");
        nsyms = sz / 24;
        if (!(by_sym = calloc(nsyms ? nsyms : 1, sizeof *by_sym)))
            return R_OUT_OF_MEMORY;
        for (size_t s = 1; s < nsyms; s++) {
            const unsigned char *sym = d + off + s * 24;
            uint32_t at = u32(sym);
            if (!u16(sym + 6) || at >= strsz || !memchr(d + stroff + at, 0, strsz - at))
                continue;
            const char *n = (const char *)d + stroff + at;
            if ((sym[4] & 0xf) == STT_OBJECT) {
                if (add_global(&e, img, sym, n)) {
                    free(by_sym);
                    return R_OUT_OF_MEMORY;
                }
                continue;
            }
            if ((sym[4] & 0xf) != STT_FUNC || !(sym[5] & STO_CUDA_ENTRY))
                continue;
            struct simgpu_kernel *k = add_kernel(img, n, strlen(n));
            if (!k) {
                free(by_sym);
                return R_OUT_OF_MEMORY;
            }
            k->params_known = 1;   /* a cubin lists every parameter (EIATTR_KPARAM_INFO) */
            by_sym[s] = (size_t)(k - img->kernels) + 1;
        }
    }
    for (unsigned i = 1; i < e.shnum; i++) {
        if (elf_section(&e, i, &type, &off, &sz, &link, &name))
            continue;
        if (!strncmp(name, ".nv.shared.", 11)) {
            struct simgpu_kernel *k = (struct simgpu_kernel *)simgpu_image_find(img, name + 11);
            if (k)
                k->shared_bytes = (int)sz;
            continue;
        }
        if (strncmp(name, ".nv.info", 8) || (name[8] && name[8] != '.') || type == SHT_NOBITS)
            continue;
        struct simgpu_kernel *owner = name[8] ? (struct simgpu_kernel *)simgpu_image_find(img, name + 9) : NULL;
        for (uint64_t p = 0; p + 4 <= sz;) {
            const unsigned char *r = d + off + p;
            unsigned fmt = r[0], attr = r[1], len = fmt == EIFMT_SVAL ? u16(r + 2) : 0;
            if (p + 4 + len > sz)
                break;
            if (fmt == EIFMT_SVAL && !owner && len >= 8 && (attr == EIATTR_REGCOUNT || attr == EIATTR_FRAME_SIZE)) {
                uint32_t s = u32(r + 4), v = u32(r + 8);
                if (s < nsyms && by_sym[s]) {
                    struct simgpu_kernel *k = &img->kernels[by_sym[s] - 1];
                    if (attr == EIATTR_REGCOUNT)
                        k->regs = (int)v;
                    else
                        k->local_bytes = (int)v;
                }
            } else if (fmt == EIFMT_SVAL && owner && len >= 12 && (attr == EIATTR_MAX_THREADS || attr == EIATTR_REQNTID)) {
                uint64_t t = (uint64_t)u32(r + 4) * u32(r + 8) * u32(r + 12);
                if (t && t <= 1024)
                    owner->max_threads = (int)t;
            } else if (fmt == EIFMT_SVAL && owner && len >= 12 && attr == EIATTR_KPARAM_INFO) {
                struct simgpu_param *q = kernel_param(owner, u16(r + 8));
                if (!q) {
                    free(by_sym);
                    return R_OUT_OF_MEMORY;
                }
                q->offset = u16(r + 10);
                q->size = u32(r + 12) >> KPARAM_SIZE_SHIFT;
            }
            p += 4 + len;
        }
    }
    free(by_sym);
    img->names_known = 1;
    img->arch = arch;
    return R_SUCCESS;
}

/* === fatbin === */

static int read_fatbin(const unsigned char *d, size_t size, int cc, struct simgpu_image *img, char *log, size_t loglen)
{
    if (size < 16 || u32(d) != FATBIN_MAGIC)
        return fail(log, loglen, R_INVALID_IMAGE, "not a fatbin");
    uint64_t hs = u16(d + 6), total = u64(d + 8);
    if (hs < 16 || hs > size || total > size - hs)
        return fail(log, loglen, R_INVALID_IMAGE, "fatbin entries out of the image");
    /* the driver's choice: SASS for this device (the newest that runs), else the newest
     * PTX it can compile */
    const unsigned char *best = NULL;
    int best_arch = -1, best_sass = 0;
    for (uint64_t p = hs; p + 0x40 <= hs + total;) {
        const unsigned char *en = d + p;
        unsigned kind = u16(en), ehs = u32(en + 4);
        uint64_t psize = u64(en + 8);
        if (ehs < 0x40 || p + ehs > hs + total || psize > hs + total - p - ehs)
            return fail(log, loglen, R_INVALID_IMAGE, "fatbin entry out of the image");
        int arch = (int)u32(en + 0x1c);
        int sass = kind == 2;
        int usable = sass ? sass_runs_on(arch, cc) : kind == 1 && arch <= cc;
        if (usable && (sass > best_sass || (sass == best_sass && arch > best_arch)))
            best = en, best_arch = arch, best_sass = sass;
        p += ehs + psize;
    }
    if (!best)
        return fail(log, loglen, R_NO_BINARY_FOR_GPU, "fatbin has no code for this device (sm_%d)", cc);
    const unsigned char *payload = best + u32(best + 4);
    uint64_t psize = u64(best + 8);
    if (u64(best + 0x28) & FATBIN_COMPRESSED) {   /* readable only by NVIDIA's decompressor */
        img->names_known = 0;
        img->arch = best_arch;
        return R_SUCCESS;
    }
    if (best_sass)
        return read_elf(payload, psize, cc, 1, img, log, loglen);
    return read_ptx((const char *)payload, strnlen((const char *)payload, psize), cc, img, log, loglen);
}

/* === archives (libraries of objects) === */

static int read_archive(const unsigned char *d, size_t size, int cc, struct simgpu_image *img, char *log, size_t loglen)
{
    img->names_known = 1;
    for (size_t p = 8; p + 60 <= size;) {
        char num[11] = {0};
        memcpy(num, d + p + 48, 10);
        size_t len = strtoul(num, NULL, 10);
        if (len > size - p - 60)
            return fail(log, loglen, R_INVALID_IMAGE, "archive member out of the archive");
        const unsigned char *m = d + p + 60;
        if (len >= 64 && !memcmp(m, "\177ELF", 4)) {   /* objects; the symbol index and names are not */
            struct simgpu_image part = {0};
            int r = read_elf(m, len, cc, 1, &part, log, loglen);
            if (r == R_SUCCESS)
                r = simgpu_image_merge(img, &part, log, loglen);
            simgpu_image_free(&part);
            if (r != R_SUCCESS)
                return r;
        }
        p += 60 + len + (len & 1);
    }
    return R_SUCCESS;
}

/* Does d begin with the n bytes of m?  Compared byte by byte, so that a short stand-in
 * image (a NUL-terminated string, size unknown) is never read past its end. */
static int starts(const unsigned char *d, size_t size, const void *m, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((size && i >= size) || d[i] != ((const unsigned char *)m)[i])
            return 0;
    return 1;
}

static const unsigned char fatbin_magic[4] = {0x50, 0xed, 0x55, 0xba}, wrapper_magic[4] = {0xb1, 0x43, 0x62, 0x46};

int simgpu_image_read(const void *data, size_t size, int kind, int cc, struct simgpu_image *out, char *log,
                      size_t loglen)
{
    memset(out, 0, sizeof *out);
    if (log && loglen)
        log[0] = 0;
    if (!data)
        return R_INVALID_VALUE;
    const unsigned char *d = data;
    int r;
    if (kind == IMG_NVVM)
        return fail(log, loglen, R_NOT_SUPPORTED, "NVVM IR (LTO) input needs nvJitLink, not the driver's linker");
    if (kind == IMG_ANY && starts(d, size, wrapper_magic, 4)) {   /* what nvcc embeds in host code */
        d = (const unsigned char *)(uintptr_t)u64(d + 8);
        if (!d)
            return fail(log, loglen, R_INVALID_IMAGE, "fatbin wrapper without a fatbin");
        size = 0;
    }
    int is_elf = starts(d, size, "\177ELF", 4), is_fatbin = starts(d, size, fatbin_magic, 4),
        is_ar = starts(d, size, "!<arch>\n", 8);
    if (!size)
        size = is_elf ? elf_extent(d) : is_fatbin ? 16 + (size_t)u64(d + 8) : strlen((const char *)d);
    switch (kind) {
    case IMG_CUBIN:
    case IMG_OBJECT:
        r = read_elf(d, size, cc, 1, out, log, loglen);
        break;
    case IMG_PTX:
        r = read_ptx((const char *)d, strnlen((const char *)d, size), cc, out, log, loglen);
        break;
    case IMG_FATBIN:
        r = read_fatbin(d, size, cc, out, log, loglen);
        break;
    case IMG_LIBRARY:
        r = is_ar ? read_archive(d, size, cc, out, log, loglen)
                  : fail(log, loglen, R_INVALID_IMAGE, "library is not an ar archive");
        break;
    case IMG_ANY:
        if (is_elf)
            r = read_elf(d, size, cc, 1, out, log, loglen);
        else if (is_fatbin)
            r = read_fatbin(d, size, cc, out, log, loglen);
        else if (memmem(d, strnlen((const char *)d, size), ".version", 8) &&
                 memmem(d, strnlen((const char *)d, size), ".target", 7))
            r = read_ptx((const char *)d, strnlen((const char *)d, size), cc, out, log, loglen);
        else
            r = R_SUCCESS;   /* a stand-in image: names_known stays 0 */
        break;
    default:
        r = fail(log, loglen, R_INVALID_VALUE, "unknown input type %d", kind);
    }
    if (r != R_SUCCESS)
        simgpu_image_free(out);
    return r;
}

int simgpu_image_merge(struct simgpu_image *into, const struct simgpu_image *from, char *log, size_t loglen)
{
    if (!from->names_known)
        into->names_known = 0;   /* a stand-in input: any name may be in the result */
    for (size_t i = 0; i < from->count; i++) {
        const struct simgpu_kernel *k = &from->kernels[i];
        if (simgpu_image_find(into, k->name))
            return fail(log, loglen, R_INVALID_IMAGE, "kernel %s defined twice", k->name);
        struct simgpu_kernel *n = add_kernel(into, k->name, strlen(k->name));
        if (!n)
            return R_OUT_OF_MEMORY;
        char *name = n->name;
        *n = *k;
        n->name = name;
        n->params = NULL;
        if (k->nparams) {   /* the image owns its copy */
            if (!(n->params = malloc((size_t)k->nparams * sizeof *n->params)))
                return R_OUT_OF_MEMORY;
            memcpy(n->params, k->params, (size_t)k->nparams * sizeof *n->params);
        }
    }
    if (from->arch > into->arch)
        into->arch = from->arch;
    return R_SUCCESS;
}

/* === writing a cubin ===
 * Sections: null, .shstrtab, .strtab, .symtab, .nv.info (register and frame sizes of
 * every kernel), then per kernel .text.<name> (16 bytes: simgpu runs no code),
 * .nv.info.<name> (its thread limit and parameters) and .nv.shared.<name> (NOBITS, its static shared
 * memory).  A stand-in result (some input's names unknown) is the stand-in image itself.
 * Variables are not written: a linked image hands out no globals (cuModuleGetGlobal). */

struct buf { unsigned char *d; size_t len, cap; int oom; };

static size_t put(struct buf *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n)
            cap *= 2;
        unsigned char *d = realloc(b->d, cap);
        if (!d) {
            b->oom = 1;
            return b->len;
        }
        b->d = d, b->cap = cap;
    }
    size_t at = b->len;
    if (p)
        memcpy(b->d + at, p, n);
    else
        memset(b->d + at, 0, n);
    b->len += n;
    return at;
}

static void put16(struct buf *b, uint16_t v) { unsigned char x[2] = {(unsigned char)v, (unsigned char)(v >> 8)}; put(b, x, 2); }
static void put32(struct buf *b, uint32_t v) { put16(b, (uint16_t)v); put16(b, (uint16_t)(v >> 16)); }
static void put64(struct buf *b, uint64_t v) { put32(b, (uint32_t)v); put32(b, (uint32_t)(v >> 32)); }
static void align(struct buf *b, size_t a) { put(b, NULL, (a - b->len % a) % a); }

struct shdr { uint32_t name, type; uint64_t flags, off, size; uint32_t link, info; uint64_t align, entsize; };

void *simgpu_image_write(const struct simgpu_image *img, int cc, size_t *size)
{
    static const char stand_in[] = "simgpu stand-in image (linked from inputs simgpu cannot read)";
    if (!img->names_known) {
        void *p = malloc(sizeof stand_in);
        if (p) {
            memcpy(p, stand_in, sizeof stand_in);
            *size = sizeof stand_in;
        }
        return p;
    }
    size_t n = img->count, nsec = 5 + 3 * n;
    struct shdr *sh = calloc(nsec, sizeof *sh);
    struct buf shstr = {0}, str = {0}, out = {0};
    if (!sh)
        return NULL;
    put(&shstr, "", 1), put(&str, "", 1);
#define SECNAME(i, fmt, ...)                                  \
    do {                                                      \
        char nm_[512];                                        \
        snprintf(nm_, sizeof nm_, fmt, __VA_ARGS__);          \
        sh[i].name = (uint32_t)put(&shstr, nm_, strlen(nm_) + 1); \
    } while (0)
    SECNAME(1, "%s", ".shstrtab");
    SECNAME(2, "%s", ".strtab");
    SECNAME(3, "%s", ".symtab");
    SECNAME(4, "%s", ".nv.info");
    for (size_t i = 0; i < n; i++) {
        SECNAME(5 + 3 * i, ".text.%s", img->kernels[i].name);
        SECNAME(6 + 3 * i, ".nv.info.%s", img->kernels[i].name);
        SECNAME(7 + 3 * i, ".nv.shared.%s", img->kernels[i].name);
    }
#undef SECNAME
    put(&out, NULL, 64);   /* the ELF header, written last */
    /* .shstrtab, .strtab */
    sh[1] = (struct shdr){sh[1].name, 3, 0, out.len, shstr.len, 0, 0, 1, 0};
    put(&out, shstr.d, shstr.len);
    uint32_t *name_at = calloc(n ? n : 1, sizeof *name_at);
    for (size_t i = 0; name_at && i < n; i++)
        name_at[i] = (uint32_t)put(&str, img->kernels[i].name, strlen(img->kernels[i].name) + 1);
    sh[2] = (struct shdr){sh[2].name, 3, 0, out.len, str.len, 0, 0, 1, 0};
    put(&out, str.d, str.len);
    /* .symtab: null, then one entry symbol per kernel */
    align(&out, 8);
    sh[3] = (struct shdr){sh[3].name, SHT_SYMTAB, 0, out.len, 24 * (n + 1), 2, 1, 8, 24};
    put(&out, NULL, 24);
    for (size_t i = 0; i < n; i++) {
        put32(&out, name_at ? name_at[i] : 0);
        unsigned char info[2] = {0x10 | STT_FUNC, STO_CUDA_ENTRY};   /* GLOBAL FUNC, entry */
        put(&out, info, 2);
        put16(&out, (uint16_t)(5 + 3 * i));
        put64(&out, 0);
        put64(&out, 16);
    }
    /* .nv.info: REGCOUNT and FRAME_SIZE per kernel */
    align(&out, 4);
    size_t info_at = out.len;
    for (size_t i = 0; i < n; i++) {
        unsigned char hdr_rc[4] = {EIFMT_SVAL, EIATTR_REGCOUNT, 8, 0}, hdr_fs[4] = {EIFMT_SVAL, EIATTR_FRAME_SIZE, 8, 0};
        put(&out, hdr_rc, 4), put32(&out, (uint32_t)(i + 1)), put32(&out, (uint32_t)img->kernels[i].regs);
        put(&out, hdr_fs, 4), put32(&out, (uint32_t)(i + 1)), put32(&out, (uint32_t)img->kernels[i].local_bytes);
    }
    sh[4] = (struct shdr){sh[4].name, 0x70000000, 0, info_at, out.len - info_at, 3, 0, 4, 0};
    for (size_t i = 0; i < n; i++) {
        const struct simgpu_kernel *k = &img->kernels[i];
        size_t s = 5 + 3 * i;
        align(&out, 128);
        sh[s] = (struct shdr){sh[s].name, 1, 0x6, out.len, 16, 3, (uint32_t)(i + 1), 128, 0};
        put(&out, NULL, 16);
        align(&out, 4);
        size_t at = out.len;
        if (k->max_threads) {
            unsigned char h[4] = {EIFMT_SVAL, EIATTR_MAX_THREADS, 12, 0};
            put(&out, h, 4), put32(&out, (uint32_t)k->max_threads), put32(&out, 1), put32(&out, 1);
        }
        for (int j = 0; j < k->nparams; j++) {
            unsigned char h[4] = {EIFMT_SVAL, EIATTR_KPARAM_INFO, 12, 0};
            put(&out, h, 4), put32(&out, 0), put16(&out, (uint16_t)j), put16(&out, (uint16_t)k->params[j].offset);
            put32(&out, k->params[j].size << KPARAM_SIZE_SHIFT | KPARAM_CBANK);
        }
        sh[s + 1] = (struct shdr){sh[s + 1].name, 0x70000000, 0x40, at, out.len - at, 3, (uint32_t)s, 4, 0};
        sh[s + 2] = (struct shdr){sh[s + 2].name, SHT_NOBITS, 0x43, out.len, (uint64_t)k->shared_bytes, 0,
                                  (uint32_t)s, 4, 0};
    }
    align(&out, 8);
    uint64_t shoff = out.len;
    for (size_t i = 0; i < nsec; i++) {
        put32(&out, sh[i].name), put32(&out, sh[i].type), put64(&out, sh[i].flags), put64(&out, 0);
        put64(&out, sh[i].off), put64(&out, sh[i].size), put32(&out, sh[i].link), put32(&out, sh[i].info);
        put64(&out, sh[i].align), put64(&out, sh[i].entsize);
    }
    free(sh), free(name_at), free(shstr.d), free(str.d);
    if (out.oom || shstr.oom || str.oom) {
        free(out.d);
        return NULL;
    }
    /* the ELF header: CUDA ABI version 7, the SM in e_flags' low byte */
    struct buf h = {out.d, 0, out.cap, 0};
    unsigned char ident[16] = {0x7f, 'E', 'L', 'F', 2, 1, 1, 0x33, 7};
    put(&h, ident, 16);
    put16(&h, 2), put16(&h, EM_CUDA), put32(&h, 1), put64(&h, 0), put64(&h, 0), put64(&h, shoff);
    put32(&h, (uint32_t)cc | 0x500u | (uint32_t)cc << 16), put16(&h, 64), put16(&h, 56), put16(&h, 0);
    put16(&h, 64), put16(&h, (uint16_t)nsec), put16(&h, 1);
    *size = out.len;
    return out.d;
}
