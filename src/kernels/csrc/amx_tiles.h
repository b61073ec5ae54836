/* What the AMX kernels share: Linux's permission for the tile state, and the tile
 * configuration (palette 1, every tile 64 bytes a row, its row count per tile). */
#ifndef SERVICER_AMX_TILES_H
#define SERVICER_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the tile registers' state only to processes that ask for it (once). */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

/* amx_request_tiles, asked once per library (a benign race: every thread asks the same). */
static inline int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = amx_request_tiles();
    return granted;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* Tiles 0-7 with rows[t] rows of 64 bytes (0 rows is configured as 1: such a tile is unused). */
static inline void amx_configure(const int rows[8]) {
    amx_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(rows[t] > 0 ? rows[t] : 1);
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif
