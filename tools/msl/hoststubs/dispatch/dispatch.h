// Stub of the libdispatch API used by lily (see ../README.md); not Apple's header.
#pragma once
#import <Foundation/Foundation.h>

@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_data <OS_dispatch_object>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
typedef NSObject<OS_dispatch_data>* dispatch_data_t;
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
#define DISPATCH_DATA_DESTRUCTOR_DEFAULT NULL
NS_ASSUME_NONNULL_BEGIN
#ifdef __cplusplus
extern "C" {
#endif
dispatch_data_t dispatch_data_create(const void* buffer, size_t size, dispatch_queue_t _Nullable queue,
                                     dispatch_block_t _Nullable destructor);
#ifdef __cplusplus
}
#endif
NS_ASSUME_NONNULL_END
