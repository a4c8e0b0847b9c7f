// Stub of the Metal API used by lily (see ../README.md); not Apple's header. Selectors and types follow
// Apple's Metal documentation.
#pragma once
#import <Foundation/Foundation.h>
#import <dispatch/dispatch.h>

// Apple marks these API_AVAILABLE(macos(15.0)); the stub checks that uses sit under @available.
#define API_AVAILABLE_MACOS15 __attribute__((availability(macos, introduced = 15.0)))

NS_ASSUME_NONNULL_BEGIN
typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
  MTLResourceCPUCacheModeDefaultCache = 0,
  MTLResourceStorageModeShared = 0UL << 4,
  MTLResourceStorageModePrivate = 2UL << 4,
  MTLResourceHazardTrackingModeDefault = 0UL << 8,
  MTLResourceHazardTrackingModeTracked = 2UL << 8,
};
typedef NS_ENUM(NSUInteger, MTLDispatchType) { MTLDispatchTypeSerial = 0, MTLDispatchTypeConcurrent = 1 };
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope) {
  MTLBarrierScopeBuffers = 1UL << 0,
  MTLBarrierScopeTextures = 1UL << 1,
  MTLBarrierScopeRenderTargets = 1UL << 2,
};
typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
  MTLCommandBufferStatusNotEnqueued = 0, MTLCommandBufferStatusEnqueued = 1, MTLCommandBufferStatusCommitted = 2,
  MTLCommandBufferStatusScheduled = 3, MTLCommandBufferStatusCompleted = 4, MTLCommandBufferStatusError = 5,
};
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
  MTLGPUFamilyApple7 = 1007, MTLGPUFamilyApple8 = 1008, MTLGPUFamilyApple9 = 1009, MTLGPUFamilyApple10 = 1010,
  MTLGPUFamilyMetal3 = 5001, MTLGPUFamilyMetal4 = 5002,
};
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
  MTLLanguageVersion3_0 = (3 << 16), MTLLanguageVersion3_1 = (3 << 16) + 1, MTLLanguageVersion3_2 = (3 << 16) + 2,
  MTLLanguageVersion4_0 = (4 << 16),
};
typedef NS_ENUM(NSInteger, MTLMathMode) { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 };
typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions) {
  MTLMathFloatingPointFunctionsFast = 0, MTLMathFloatingPointFunctionsPrecise = 1,
};
typedef NS_OPTIONS(NSUInteger, MTLPipelineOption) {
  MTLPipelineOptionNone = 0, MTLPipelineOptionArgumentInfo = 1 << 0, MTLPipelineOptionBufferTypeInfo = 1 << 1,
  MTLPipelineOptionFailOnBinaryArchiveMiss = 1 << 2,
};
typedef struct {
  NSUInteger width, height, depth;
} MTLSize;
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize s = {width, height, depth};
  return s;
}

@protocol MTLResource <NSObject>
@end
@protocol MTLBuffer <MTLResource>
- (void*)contents NS_RETURNS_INNER_POINTER;
@property (readonly) NSUInteger length;
@end
@protocol MTLFunction <NSObject>
@end
@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@property (readonly) NSArray<NSString*>* functionNames;
@end
@interface MTLCompileOptions : NSObject <NSCopying>
@property (readwrite, nonatomic) BOOL fastMathEnabled;  // deprecated in macOS 15 for mathMode
@property (readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE_MACOS15;
@property (readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions API_AVAILABLE_MACOS15;
@property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
@end
@class MTLComputePipelineDescriptor;
@protocol MTLBinaryArchive <NSObject>
- (BOOL)addComputePipelineFunctionsWithDescriptor:(MTLComputePipelineDescriptor*)descriptor
                                            error:(NSError* _Nullable* _Nullable)error;
- (BOOL)serializeToURL:(NSURL*)url error:(NSError* _Nullable* _Nullable)error;
@end
@interface MTLBinaryArchiveDescriptor : NSObject <NSCopying>
@property (nullable, readwrite, nonatomic, copy) NSURL* url;
@end
@interface MTLComputePipelineDescriptor : NSObject <NSCopying>
@property (nullable, readwrite, nonatomic, strong) id<MTLFunction> computeFunction;
@property (nullable, readwrite, nonatomic, copy) NSArray<id<MTLBinaryArchive>>* binaryArchives;
@end
@interface MTLComputePipelineReflection : NSObject
@end
typedef __autoreleasing MTLComputePipelineReflection* _Nullable MTLAutoreleasedComputePipelineReflection;
@protocol MTLComputePipelineState <NSObject>
@property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property (readonly) NSUInteger threadExecutionWidth;
@end
@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
@end
@protocol MTLCommandBuffer <NSObject>
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType)dispatchType;
- (void)commit;
- (void)waitUntilCompleted;
@property (readonly) MTLCommandBufferStatus status;
@property (nullable, readonly) NSError* error;
@end
@protocol MTLCommandQueue <NSObject>
- (nullable id<MTLCommandBuffer>)commandBuffer;
@end
@protocol MTLDevice <NSObject>
@property (readonly) NSString* name;
@property (readonly) BOOL hasUnifiedMemory;
- (nullable id<MTLCommandQueue>)newCommandQueue;
- (nullable id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytesNoCopy:(void*)pointer
                                             length:(NSUInteger)length
                                            options:(MTLResourceOptions)options
                                        deallocator:(void (^_Nullable)(void* pointer, NSUInteger length))deallocator;
- (nullable id<MTLLibrary>)newLibraryWithData:(dispatch_data_t)data error:(NSError* _Nullable* _Nullable)error;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(NSError* _Nullable* _Nullable)error;
- (nullable id<MTLBinaryArchive>)newBinaryArchiveWithDescriptor:(MTLBinaryArchiveDescriptor*)descriptor
                                                          error:(NSError* _Nullable* _Nullable)error;
- (nullable id<MTLComputePipelineState>)
    newComputePipelineStateWithDescriptor:(MTLComputePipelineDescriptor*)descriptor
                                  options:(MTLPipelineOption)options
                               reflection:(MTLAutoreleasedComputePipelineReflection* _Nullable)reflection
                                    error:(NSError* _Nullable* _Nullable)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                                      error:(NSError* _Nullable* _Nullable)error;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
@end

#ifdef __cplusplus
extern "C" {
#endif
id<MTLDevice> _Nullable MTLCreateSystemDefaultDevice(void);
#ifdef __cplusplus
}
#endif
NS_ASSUME_NONNULL_END
